"""The prompt's bound, turn by turn: the bytes the proxy forwards, plus the template's
margin, unless the body carries media (`gate.request_body.turn_media`), which is looked
for only in the history items a session's earlier turns did not show.

Pure tests of `turn_media` against the byte scan (`prompt_token_bound`), then a gate with a
fake probe: a turn is priced at the caller's bytes, a session whose new message carries
an image is probed until its history is rewritten, and one whose usage outgrows its
bound has its history read whole.
"""

from __future__ import annotations

import orjson
import pytest

from kvgate.gate import request_body
from kvgate.gate.gate import Gate
from kvgate.gate.metrics import GateMetrics
from kvgate.gate.request_body import (
    TEMPLATE_MARGIN_TOKENS,
    THREADS_KEPT,
    HistoryMedia,
    holds_media,
    item_digest,
    prompt_token_bound,
    rendered_item,
    turn_media,
)
from kvgate.wire.blocks import cdiv
from tests.gate.helpers import FakeClock, FakeProbe, assert_clean, settings

pytestmark = pytest.mark.usefixtures("loop_on_clock")

TEXT = {"role": "user", "content": "hello"}
ASSISTANT = {"role": "assistant", "content": "ok"}
IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
IMAGE = {"role": "user", "content": [{"type": "text", "text": "look"}, IMAGE_PART]}

# One body per shape the routes take, with media and without (tool definitions beside).
BODIES = [
    ("chat", {"messages": [TEXT, {"role": "assistant", "content": "ok"}]}),
    ("chat", {"messages": [TEXT, IMAGE]}),
    ("chat", {"messages": [TEXT, {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}),
    ("chat", {"messages": [{"role": "user", "content": [{"image_url": {"url": "u"}}]}]}),  # no `type`
    (
        "messages",  # Anthropic: an image inside a tool result
        {
            "system": [{"type": "text", "text": "be brief"}],
            "messages": [
                TEXT,
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}],
                },
            ],
        },
    ),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}),
    ("responses", {"input": "just text"}),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}),
    ("responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": "done"}]}),
]


@pytest.mark.parametrize(("route_kind", "fields"), BODIES)
def test_turn_media_finds_what_the_byte_scan_finds(route_kind, fields):
    body = {"model": "m", **fields}
    media, threads = turn_media(route_kind, body, ())
    assert media == (prompt_token_bound(orjson.dumps(body)) is None)
    history = body.get("messages", body.get("input"))
    assert threads == (
        (HistoryMedia(len(history), media, *map(item_digest, (history[0], history[-1]))),)
        if isinstance(history, list)
        else ()
    )


def test_a_tool_definition_is_not_media():
    """Tool kinds and JSON-schema types are not content parts (the byte scan took
    Responses' `file_search` tool for a file)."""
    body = {"input": "hi", "tools": [{"type": "file_search"}, {"type": "function", "parameters": {"type": "object"}}]}
    assert prompt_token_bound(orjson.dumps(body)) is None
    assert turn_media("responses", body, ()) == (False, ())  # an empty history is no thread


def read(history: list[dict], seen: HistoryMedia) -> tuple[bool, HistoryMedia]:
    """One thread's turn: whether it carries media, and the thread as then seen."""
    answer = turn_media("chat", {"messages": history}, (seen,) if seen.items else ())
    assert answer is not None
    media, (thread, *_) = answer
    return media, thread


def test_only_the_items_a_history_adds_are_read():
    """The first and the last item read say the body continues the history: only what
    follows is read (an image between them goes unseen here; the turn's usage shows it)."""
    media, seen = read([TEXT, TEXT, ASSISTANT], HistoryMedia())
    assert (media, seen) == (False, HistoryMedia(3, False, item_digest(TEXT), item_digest(ASSISTANT)))
    assert read([TEXT, IMAGE, ASSISTANT, TEXT], seen)[0] is False  # unseen: between the first and the last read
    # media once seen stays while the history continues
    media, seen = read([TEXT, TEXT, ASSISTANT, IMAGE], seen)
    assert media and read([TEXT, TEXT, ASSISTANT, IMAGE, TEXT], seen)[0]


@pytest.mark.parametrize(
    "other",
    [
        [TEXT],  # compacted: shorter
        [{"role": "user", "content": "a subagent's task"}, ASSISTANT, TEXT],  # another thread, as long
        [TEXT, {"role": "assistant", "content": "another reply"}, TEXT, TEXT],  # longer, not this history's
    ],
)
def test_a_history_that_does_not_continue_the_one_read_is_read_whole(other):
    _, seen = read([IMAGE, ASSISTANT], HistoryMedia())
    assert seen.media
    first, last = item_digest(other[0]), item_digest(other[-1])
    assert read(other, seen) == (False, HistoryMedia(len(other), False, first, last))
    _, seen = read([TEXT, ASSISTANT], HistoryMedia())
    assert read([IMAGE, *other], seen)[0]


def test_interleaved_threads_each_read_only_what_they_add(monkeypatch):
    """A main thread, a subagent and a title request take turns in one session: each body
    continues its own thread's history, so each reads only its new items, and an image
    one thread showed stays with that thread alone."""
    read_items: list[int] = []

    def counted(value: object) -> bool:
        read_items.append(len(value) if isinstance(value, list) else 1)
        return holds_media(value)

    monkeypatch.setattr(request_body, "holds_media", counted)
    main = [TEXT, ASSISTANT]
    sub = [{"role": "user", "content": "a subagent's task"}, IMAGE]
    title = [{"role": "user", "content": "name this conversation"}]
    threads: tuple[HistoryMedia, ...] = ()
    for history, media in [(main, False), (sub, True), (title, False), (main + [TEXT], False), (sub + [TEXT], True)]:
        read_items.clear()
        answer = turn_media("chat", {"messages": history}, threads)
        assert answer is not None
        assert answer[0] is media, history
        threads = answer[1]
        assert sum(read_items) <= 2  # a new thread's items, or the one its history added
    assert [t.items for t in threads] == [3, 3, 1]  # the latest first
    # a title request of the main thread's first message alone: the main thread's next turn
    # continues both histories, and reads on from the longer one's
    threads = turn_media("chat", {"messages": main[:1]}, threads)[1]
    read_items.clear()
    threads = turn_media("chat", {"messages": main + [TEXT, ASSISTANT]}, threads)[1]
    assert sum(read_items) == 1 and threads[0].items == 4
    for n in range(THREADS_KEPT + 1):  # more threads than are kept: the least recent go
        threads = turn_media("chat", {"messages": [{"role": "user", "content": f"task {n}"}]}, threads)[1]
    assert len(threads) == THREADS_KEPT and all(t.items == 1 for t in threads)


MARK = {"type": "ephemeral"}


def marked(message: dict) -> dict:
    """`message` as an Anthropic client sends its newest one: a prompt-caching mark on its
    last content part, a string content sent as a list of one text part."""
    content = message["content"]
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else [dict(p) for p in content]
    parts[-1]["cache_control"] = MARK
    return {**message, "content": parts}


def test_an_item_is_digested_as_its_prompt_renders_it():
    tool_result = {"type": "tool_result", "tool_use_id": "t", "content": "ok"}
    assert rendered_item(marked(TEXT)) == TEXT  # a list of one text part is its text
    results = {"role": "user", "content": [tool_result]}
    assert rendered_item(marked(results)) == results
    assert rendered_item({**TEXT, "cache_control": MARK}) == TEXT  # a mark on the message itself
    two = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert rendered_item(marked(two)) == two  # two parts stay two parts
    assert rendered_item(IMAGE) is IMAGE and rendered_item(TEXT) is TEXT  # nothing to take off: the item itself
    sent = marked(TEXT)
    rendered_item(sent)
    assert sent["content"][0]["cache_control"] == MARK  # never changed in place
    assert item_digest(marked(TEXT)) == item_digest(TEXT)
    assert item_digest(marked({"role": "user", "content": "other"})) != item_digest(TEXT)
    assert item_digest(marked(IMAGE)) == item_digest(IMAGE) != item_digest({**IMAGE, "content": IMAGE["content"][:1]})


def test_a_mark_inside_a_tool_results_own_content_is_taken_off_too():
    """A tool_result's content may be a list of parts, each of which may carry the mark: the
    result renders the same prompt marked or not, and as its text when it is one text part."""
    part = {"type": "text", "text": "README.md"}
    unmarked = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "README.md"}]}
    inner_marked = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{**part, "cache_control": MARK}]}],
    }
    assert rendered_item(inner_marked) == unmarked
    assert item_digest(inner_marked) == item_digest(unmarked)
    as_list = {"role": "user", "content": [{**unmarked["content"][0], "content": [part]}]}
    assert item_digest(as_list) == item_digest(unmarked)  # one text part unmarked: its text too
    two = [part, {"type": "text", "text": "setup.py", "cache_control": MARK}]
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": two}]}
    clean = [part, {"type": "text", "text": "setup.py"}]
    assert rendered_item(result) == {"role": "user", "content": [{**result["content"][0], "content": clean}]}
    assert two[1]["cache_control"] == MARK  # never changed in place
    assert item_digest(result) != item_digest(unmarked)  # another result


def test_an_agent_that_moves_its_cache_mark_continues_its_thread(monkeypatch):
    """Claude Code marks its newest message for prompt caching, and sends it unmarked (a
    string again) a turn later: its bodies still continue one thread, each reading only
    the items its turn added."""
    read_items: list[int] = []

    def counted(value: object) -> bool:
        read_items.append(len(value) if isinstance(value, list) else 1)
        return holds_media(value)

    monkeypatch.setattr(request_body, "holds_media", counted)
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "Bash", "input": {"cmd": "ls"}}]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "README.md"}]}
    history = [TEXT]
    threads: tuple[HistoryMedia, ...] = ()
    for turn in range(4):
        read_items.clear()
        body = orjson.loads(orjson.dumps({"messages": [*history[:-1], marked(history[-1])]}))  # as parsed off the wire
        media, threads = turn_media("messages", body, threads)
        assert not media and len(threads) == 1 and threads[0].items == len(history), (turn, threads)
        assert sum(read_items) <= 2  # the first turn's two items, or the two a turn added
        history += [call, result]


def test_fields_beside_the_history_are_read_every_turn():
    assert turn_media("completion", {"prompt": "hi"}, ()) is None  # no history: its bytes are read
    assert turn_media("chat", {"messages": "not a list"}, ()) is None
    thread = (HistoryMedia(1, False, item_digest(TEXT), item_digest(TEXT)),)
    assert turn_media("chat", {"messages": [TEXT], "prompt_embeds": "x"}, thread)[0]
    system_image = {"system": [{"type": "image", "source": {}}], "messages": [TEXT]}
    assert turn_media("messages", system_image, thread)[0]
    assert not holds_media({"text": '"type":"image_url"'})  # a string is text, whatever it says


# ------------------------------------------------------------------ the gate


def calm_gate(metrics: GateMetrics, clock: FakeClock) -> tuple[Gate, FakeProbe]:
    probe = FakeProbe(usage=0.01, total=100_000, free=99_000, block_size=16)
    return Gate("r0", probe, settings(), metrics, clock=clock), probe


def chat(messages: list[dict], **fields) -> dict:
    return {"id": "s", "messages": messages, "max_tokens": 16, **fields}


async def test_a_turn_is_priced_at_the_bytes_its_caller_forwards(metrics: GateMetrics, clock: FakeClock):
    gate, probe = calm_gate(metrics, clock)
    lease = await gate.acquire("s", "chat", chat([TEXT]), body_size=4000)
    assert gate.session_state("s")["footprint_blocks"] == cdiv(4000 + TEMPLATE_MARGIN_TOKENS + 16, 16)
    lease.release()
    body = chat([TEXT, TEXT])  # without them: one compact encoding of the body
    lease = await gate.acquire("s", "chat", body)
    encoded = len(orjson.dumps(body))
    assert gate.session_state("s")["footprint_blocks"] == cdiv(encoded + TEMPLATE_MARGIN_TOKENS + 16, 16)
    lease.release()
    assert probe.prefix_calls == []  # both bounds fit: no probe
    gate.finish_session("s")
    assert_clean(gate, clock)


async def test_an_image_in_a_new_message_is_probed_until_the_history_is_rewritten(
    metrics: GateMetrics, clock: FakeClock
):
    gate, probe = calm_gate(metrics, clock)
    turns = [
        ([TEXT], 0),  # text: priced at its bound
        ([TEXT, TEXT, IMAGE], 1),  # an image: no bound, so the prefix is probed
        ([TEXT, TEXT, IMAGE, TEXT, TEXT], 2),  # the image is still in its history
        ([TEXT], 2),  # compacted: read again, text only
    ]
    for messages, probes in turns:
        body = chat(messages)
        lease = await gate.acquire("s", "chat", body, body_size=len(orjson.dumps(body)))
        lease.release()
        assert len(probe.prefix_calls) == probes, messages
    gate.finish_session("s")
    assert_clean(gate, clock)


async def test_an_image_put_into_an_earlier_message_is_found_once_the_usage_outgrows_the_bound(
    metrics: GateMetrics, clock: FakeClock
):
    """An image put into a message before the one read last is not read (the history
    continues it); the turn's usage shows more prompt tokens than its body's bytes bound,
    and the next turn reads the history whole."""
    gate, probe = calm_gate(metrics, clock)
    turns = [[TEXT, ASSISTANT, TEXT, ASSISTANT], [TEXT, IMAGE, TEXT, ASSISTANT, TEXT]]
    turns.append([*turns[1], ASSISTANT])
    for k, messages in enumerate(turns):
        body = chat(messages)
        size = len(orjson.dumps(body))
        lease = await gate.acquire("s", "chat", body, body_size=size)
        lease.learn(size if k == 0 else 5000, 0)  # the image's tokens: more than its body's bytes bound
        lease.release()
        assert len(probe.prefix_calls) == [0, 0, 1][k]
    gate.finish_session("s")
    assert_clean(gate, clock)
