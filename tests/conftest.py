"""Shared test configuration. Part-specific fixtures live in each tests/<part>/conftest.py."""
