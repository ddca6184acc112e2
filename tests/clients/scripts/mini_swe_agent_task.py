"""A multi-turn mini-swe-agent session through kvgate, run by the client venv's python.

    mini_swe_agent_task.py BASE_URL WORKDIR SESSION_ID STEPS

mini-swe-agent's DefaultAgent with its LitellmModel (litellm's OpenAI-compatible
provider, chat completions at BASE_URL, the session id in kvgate's `x-session-id` header)
runs one task for STEPS model calls (its step limit ends the run: the simulated replica
never submits). Its one tool is `bash`; here the environment runs only read-only commands
(`ls`, `cat`, `head`, `wc`), without a shell, inside WORKDIR, and answers anything else
"not allowed": the replica's tool calls carry arbitrary strings. Prints one JSON line:
the exit status, the model calls and the commands run or refused.
"""

import json
import shlex
import subprocess
import sys
from pathlib import Path

from minisweagent.agents.default import DefaultAgent
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.litellm_model import LitellmModel

READ_ONLY = frozenset({"ls", "cat", "head", "wc"})
SYSTEM = "You answer questions about the files of a small project, using the bash tool."
INSTANCE = "{{task}}"


class ReadOnlyEnvironment(LocalEnvironment):
    """LocalEnvironment that runs a command only when it is one read-only program whose
    path arguments stay inside the work folder; never through a shell."""

    def __init__(self, workdir: Path, commands: list[dict], **kwargs) -> None:
        super().__init__(cwd=str(workdir), **kwargs)
        self.workdir = workdir
        self.commands = commands

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict:
        command = action.get("command", "")
        argv = self.allowed(command)
        self.commands.append({"command": command[:80], "ran": argv is not None})
        if argv is None:
            refusal = f"not allowed: only {sorted(READ_ONLY)} inside the project"
            return {"output": refusal, "returncode": 1, "exception_info": ""}
        result = subprocess.run(argv, cwd=self.workdir, capture_output=True, text=True, timeout=10)
        return {"output": result.stdout + result.stderr, "returncode": result.returncode, "exception_info": ""}

    def allowed(self, command: str) -> list[str] | None:
        try:
            argv = shlex.split(command)
        except ValueError:
            return None
        if not argv or argv[0] not in READ_ONLY:
            return None
        for arg in argv[1:]:
            if not arg.startswith("-") and not (self.workdir / arg).resolve().is_relative_to(self.workdir):
                return None
        return argv


def main(base_url: str, workdir: Path, session_id: str, steps: int) -> None:
    model = LitellmModel(
        model_name="openai/kvgate-sim",
        model_kwargs={
            "api_base": base_url,
            "api_key": "unused",
            "extra_headers": {"x-session-id": session_id},
            "max_tokens": 512,
        },
        cost_tracking="ignore_errors",  # litellm has no price for kvgate-sim
    )
    commands: list[dict] = []
    env = ReadOnlyEnvironment(workdir.resolve(), commands)
    agent = DefaultAgent(
        model,
        env,
        system_template=SYSTEM,
        instance_template=INSTANCE,
        step_limit=steps,
        max_consecutive_format_errors=0,  # a text answer (no tool call) is a format error: go on
    )
    result = agent.run("list the files here, then read README.md and summarise it")
    print(json.dumps({"exit_status": result.get("exit_status"), "model_calls": agent.n_calls, "commands": commands}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
