"""An OpenAI Agents SDK session of five questions through kvgate in front of real vLLM,
run by the client venv's python.

    agents_sdk_plain_task.py BASE_URL SESSION_ID API MODEL

The agent offers two tools with `tool_choice: none`: a vLLM server started without a
tool-call parser (`--enable-auto-tool-choice`) refuses any other choice, and the tests'
tiny random-weight model could not call one anyway, so each question is one model call. Replies are
capped at 16 tokens so that the five questions fit the tiny model's context. The session
id goes in kvgate's `x-session-id` header. Prints one JSON line: the model calls made.
"""

import asyncio
import json
import sys

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

QUESTIONS = (
    "list the files here",
    "what does README.md say?",
    "which file defines the entry point?",
    "is there a test folder?",
    "summarise the project in one line",
)


@function_tool
def list_files(path: str) -> str:
    """List the files under a folder of the task."""
    return "README.md\nmain.py"


@function_tool
def read_file(path: str) -> str:
    """Read a text file of the task."""
    return "a small project"


async def main(base_url: str, session_id: str, api: str, model: str) -> None:
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key="unused", default_headers={"x-session-id": session_id})
    model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    agent = Agent(
        name="reader",
        instructions="You answer questions about the files of a small project.",
        model=model_class(model=model, openai_client=client),
        tools=[list_files, read_file],
        model_settings=ModelSettings(max_tokens=16, tool_choice="none"),
    )
    history: list = []
    model_calls = 0
    for question in QUESTIONS:
        result = await Runner.run(agent, history + [{"role": "user", "content": question}], max_turns=4)
        model_calls += len(result.raw_responses)
        history = result.to_input_list()
    await client.close()
    print(json.dumps({"model_calls": model_calls}))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
