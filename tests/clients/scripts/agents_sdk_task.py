"""A multi-turn OpenAI Agents SDK session through kvgate, run by the client venv's python.

    agents_sdk_task.py BASE_URL WORKDIR SESSION_ID API

Three tasks in one conversation; each first model call must call a tool (`tool_choice`
required, reset after the tool ran, the SDK's default), later calls choose. The tools
read only inside WORKDIR. The session id goes in kvgate's `x-session-id` header. Prints
one JSON line: the model calls and tool calls made.
"""

import asyncio
import json
import sys
from pathlib import Path

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

TASKS = ("list the files here", "read README.md and summarise it", "which file defines the entry point?")


def tools_in(workdir: Path, calls: list[str]):
    def inside(path: str) -> Path | None:
        target = (workdir / path).resolve()
        return target if target.is_relative_to(workdir) else None

    @function_tool
    def list_files(path: str) -> str:
        """List the files under a folder of the task."""
        calls.append("list_files")
        folder = inside(path)
        if folder is None or not folder.is_dir():
            return f"error: {path} is not a folder of the task"
        return "\n".join(sorted(p.name for p in folder.iterdir()))

    @function_tool
    def read_file(path: str, max_lines: int | None = None) -> str:
        """Read a text file of the task."""
        calls.append("read_file")
        file = inside(path)
        if file is None or not file.is_file():
            return f"error: {path} is not a file of the task"
        return "\n".join(file.read_text().splitlines()[: max_lines or 200])

    return [list_files, read_file]


async def main(base_url: str, workdir: Path, session_id: str, api: str) -> None:
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key="unused", default_headers={"x-session-id": session_id})
    model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    calls: list[str] = []
    agent = Agent(
        name="reader",
        instructions="You answer questions about the files of a small project.",
        model=model_class(model="kvgate-sim", openai_client=client),
        tools=tools_in(workdir.resolve(), calls),
        model_settings=ModelSettings(tool_choice="required", max_tokens=512),
    )
    history: list = []
    model_calls = 0
    for task in TASKS:
        result = await Runner.run(agent, history + [{"role": "user", "content": task}], max_turns=12)
        model_calls += len(result.raw_responses)
        history = result.to_input_list()
    await client.close()
    print(json.dumps({"model_calls": model_calls, "tool_calls": calls, "final": str(result.final_output)[:80]}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]))
