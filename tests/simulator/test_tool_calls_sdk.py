"""The simulated replica's tool calls and natural stops, read by the real `openai` and
`anthropic` clients over loopback: each API's call parses in its SDK, streamed and not,
with arguments valid against the tool's schema."""

import json

import anthropic
import jsonschema
import openai
import pytest

from kvgate.simulator.replica_server import SimulatedReplica
from kvgate.simulator.reply_model import ReplyModel

READ = {
    "type": "object",
    "properties": {
        "file_path": {"type": "string"},
        "offset": {"type": "integer", "minimum": 0},
        "mode": {"type": "string", "enum": ["text", "bytes"]},
    },
    "required": ["file_path"],
    "additionalProperties": False,
}
CHAT_TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": READ}}]
RESPONSES_TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file", "parameters": READ}]
MESSAGES_TOOLS = [{"name": "read_file", "description": "Read a file", "input_schema": READ}]
ASK = "read the README and tell me what the project does"


@pytest.fixture
async def replica_with(request):
    started = []

    async def start(**reply) -> str:
        replica = await SimulatedReplica.start(time_scale=0.0, reply_model=ReplyModel(median_tokens=24, **reply))
        started.append(replica)
        return replica.url

    yield start
    for replica in started:
        await replica.stop()


async def test_chat_tool_call_parses_in_openai_sdk(replica_with):
    url = await replica_with(tool_call_rate=1.0)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused") as client:
        messages = [{"role": "user", "content": ASK}]
        answer = await client.chat.completions.create(model="m", messages=messages, tools=CHAT_TOOLS, max_tokens=4000)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.function.name == "read_file"
        jsonschema.validate(json.loads(call.function.arguments), READ)
        async with client.chat.completions.stream(
            model="m", messages=messages, tools=CHAT_TOOLS, max_tokens=4000
        ) as stream:
            streamed = (await stream.get_final_completion()).choices[0]
        # the same prompt gets the same call, streamed or not
        assert streamed.finish_reason == "tool_calls"
        assert streamed.message.tool_calls[0].function.arguments == call.function.arguments
        assert streamed.message.tool_calls[0].id == call.id
        # the call's turn continues: the tool result comes back and the session goes on
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "# kvgate"},
        ]
        again = await client.chat.completions.create(model="m", messages=messages, tools=CHAT_TOOLS, max_tokens=4000)
        assert again.usage.prompt_tokens_details.cached_tokens > 0


async def test_responses_function_call_parses_in_openai_sdk(replica_with):
    url = await replica_with(tool_call_rate=1.0)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused") as client:
        answer = await client.responses.create(model="m", input=ASK, tools=RESPONSES_TOOLS, max_output_tokens=4000)
        assert answer.status == "completed"
        (call,) = answer.output
        assert call.type == "function_call" and call.name == "read_file" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), READ)
        async with client.responses.stream(
            model="m", input=ASK, tools=RESPONSES_TOOLS, max_output_tokens=4000
        ) as stream:
            final = await stream.get_final_response()
        assert final.output[0].type == "function_call" and final.output[0].arguments == call.arguments
        # continuing from a call: the function's output is the next input
        output = [{"type": "function_call_output", "call_id": call.call_id, "output": "# kvgate"}]
        follow = await client.responses.create(
            model="m", previous_response_id=answer.id, input=output, tools=RESPONSES_TOOLS, max_output_tokens=4000
        )
        assert follow.status == "completed" and follow.usage.input_tokens_details.cached_tokens > 0


async def test_anthropic_tool_use_parses_in_anthropic_sdk(replica_with):
    url = await replica_with(tool_call_rate=1.0)
    async with anthropic.AsyncAnthropic(base_url=url, api_key="unused") as client:
        messages = [{"role": "user", "content": ASK}]
        answer = await client.messages.create(model="m", messages=messages, tools=MESSAGES_TOOLS, max_tokens=4000)
        assert answer.stop_reason == "tool_use"
        (block,) = answer.content
        assert block.type == "tool_use" and block.id.startswith("toolu_") and block.name == "read_file"
        jsonschema.validate(block.input, READ)
        async with client.messages.stream(
            model="m", messages=messages, tools=MESSAGES_TOOLS, max_tokens=4000
        ) as stream:
            final = await stream.get_final_message()
        assert final.stop_reason == "tool_use" and final.content[0].input == block.input


async def test_text_replies_stop_naturally_and_max_tokens_only_caps(replica_with):
    url = await replica_with(tool_call_rate=0.0)
    async with (
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused") as oai,
        anthropic.AsyncAnthropic(base_url=url, api_key="unused") as claude,
    ):
        messages = [{"role": "user", "content": ASK}]
        chat = await oai.chat.completions.create(model="m", messages=messages, tools=CHAT_TOOLS, max_tokens=4000)
        assert chat.choices[0].finish_reason == "stop" and 0 < chat.usage.completion_tokens < 4000
        message = await claude.messages.create(model="m", messages=messages, max_tokens=4000)
        assert message.stop_reason == "end_turn" and message.content[0].type == "text"
        response = await oai.responses.create(model="m", input=ASK, max_output_tokens=4000)
        assert response.status == "completed" and response.output[0].type == "message"
        # without max_tokens the cap is the context left, as vLLM's: the reply still ends on its own
        lengths = []
        for index in range(6):
            asked = [{"role": "user", "content": f"{ASK} ({index})"}]
            uncapped = await oai.chat.completions.create(model="m", messages=asked)
            assert uncapped.choices[0].finish_reason == "stop"
            lengths.append(uncapped.usage.completion_tokens)
            uncapped_response = await oai.responses.create(model="m", input=f"{ASK} ({index})")
            assert uncapped_response.status == "completed"
            lengths.append(uncapped_response.usage.output_tokens)
        assert max(lengths) > 16  # beyond the old default of 16
        # a cap below the drawn length cuts the reply: finish reason length, exactly the cap
        cut = await oai.chat.completions.create(model="m", messages=messages, max_tokens=1)
        assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 1
        cut_message = await claude.messages.create(model="m", messages=messages, max_tokens=1)
        assert cut_message.stop_reason == "max_tokens"
        cut_response = await oai.responses.create(model="m", input=ASK, max_output_tokens=1)
        assert cut_response.status == "incomplete"
        # vLLM's ignore_eos asks for exactly max_tokens
        fixed = await oai.chat.completions.create(
            model="m", messages=messages, max_tokens=300, extra_body={"ignore_eos": True}
        )
        assert fixed.choices[0].finish_reason == "length" and fixed.usage.completion_tokens == 300
