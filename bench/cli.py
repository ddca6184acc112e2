"""Placeholder: the owner of this part replaces it with real subcommands."""


def add_commands(subparsers) -> None:
    return None
