"""The static vLLM compatibility check itself, on hand-written and doctored sources
(no network, no vLLM: these run everywhere)."""

from __future__ import annotations

import textwrap

import pytest

from kvgate.vllm_plugin import compat_check
from kvgate.vllm_plugin.vllm_internals import Assigned, Call, Member, Symbol, Text

CORE = textwrap.dedent(
    """
    from vllm.v1.core.sched.scheduler import Scheduler as Scheduler
    from vllm.base import Base


    class EngineCore(Base):
        def __init__(self, config):
            self.scheduler: Scheduler = Scheduler(config)
            self.request_block_hasher = None

        def step(self) -> tuple[dict, bool]:
            return {}, False

        @property
        def busy(self):
            return False
    """
)
BASE = textwrap.dedent(
    """
    class Base:
        label: str = "base"

        def counts(self, *, verbose: bool = False) -> tuple[int, int]:
            return 0, 0
    """
)
SCHEDULER = textwrap.dedent(
    """
    class Scheduler:
        def __init__(self, config):
            self.block_size = config.block_size

        def find(self, block_hashes, max_length, extra=None) -> tuple[list, int, int]:
            return [], 0, 0


    class Params:
        max_tokens: int = 16
        seed: int | None = None
    """
)
APP = textwrap.dedent(
    """
    METRIC = "vllm:prompt_tokens"


    def init_app_state(state):
        state.online_renderer = object()
    """
)
RELEASE = {
    "vllm.v1.engine.core": CORE,
    "vllm.base": BASE,
    "vllm.v1.core.sched.scheduler": SCHEDULER,
    "vllm.app": APP,
}

TABLE = (
    Symbol("vllm.v1.engine.core", "EngineCore", "engine_plugin.register"),
    Symbol("vllm.v1.engine.core", "Scheduler", "engine_probes.kv_answer"),  # re-exported
    Call("vllm.v1.engine.core", "EngineCore.step", "engine_plugin.install_probes", returns=2),
    Member("vllm.v1.engine.core", "EngineCore.scheduler", "engine_probes.kv_answer"),
    Member("vllm.v1.engine.core", "EngineCore.busy", "engine_probes.kv_answer"),
    Member("vllm.v1.engine.core", "EngineCore.label", "engine_probes.kv_answer"),  # from a base in another module
    Call("vllm.v1.engine.core", "EngineCore.counts", "engine_probes.kv_answer", keywords=("verbose",), returns=2),
    Call("vllm.v1.core.sched.scheduler", "Scheduler", "engine_probes.kv_answer", positional=1),
    Call("vllm.v1.core.sched.scheduler", "Scheduler.find", "engine_probes.prefix_answer", positional=2, returns=3),
    Call("vllm.v1.core.sched.scheduler", "Params", "engine_probes.build_probe_request", keywords=("max_tokens",)),
    Assigned("vllm.app", "state.online_renderer", "rendering.render_prefix_query"),
    Text("vllm.app", "vllm:prompt_tokens", "engine_rates.SAMPLES"),
)


class Sources:
    def __init__(self, modules: dict[str, str]):
        self.modules = modules

    def read(self, module: str) -> str | None:
        return self.modules.get(module)


def doctored(module: str, old: str, new: str) -> Sources:
    assert old in RELEASE[module], "the doctoring must change something"
    return Sources({**RELEASE, module: RELEASE[module].replace(old, new)})


def test_a_release_with_everything_has_no_problems():
    assert compat_check.problems("0.34.0", Sources(RELEASE), TABLE) == []


@pytest.mark.parametrize(
    "module, old, new, symbol, says",
    [
        (
            "vllm.v1.engine.core",
            "def step(self)",
            "def stepped(self)",
            "EngineCore.step",
            "no attribute or method step",
        ),
        (
            "vllm.v1.engine.core",
            "self.scheduler: Scheduler =",
            "self.sched: Scheduler =",
            "EngineCore.scheduler",
            "scheduler",
        ),
        (
            "vllm.v1.engine.core",
            "class EngineCore(Base)",
            "class Engine(Base)",
            "EngineCore",
            "EngineCore is gone from vllm.v1.engine.core",
        ),
        ("vllm.base", 'label: str = "base"', "", "EngineCore.label", "no attribute or method label"),
        ("vllm.base", "verbose: bool = False", "loud: bool = False", "EngineCore.counts", "has no parameter verbose"),
        (
            "vllm.base",
            "*, verbose: bool = False",
            "*, verbose: bool, quiet: bool",
            "EngineCore.counts",
            "requires quiet",
        ),
        (
            "vllm.v1.core.sched.scheduler",
            "tuple[list, int, int]",
            "tuple[list, int]",
            "Scheduler.find",
            "tuple of 2 items",
        ),
        (
            "vllm.v1.core.sched.scheduler",
            "find(self, block_hashes, max_length, extra=None)",
            "find(self, block_hashes, *, max_length)",
            "Scheduler.find",
            "takes at most 1 positional arguments",
        ),
        (
            "vllm.v1.core.sched.scheduler",
            "find(self, block_hashes, max_length, extra=None)",
            "find(self, block_hashes, max_length, extra)",
            "Scheduler.find",
            "requires extra",
        ),
        ("vllm.v1.core.sched.scheduler", "def __init__(self, config)", "def __init__(self)", "Scheduler", "at most 0"),
        (
            "vllm.v1.core.sched.scheduler",
            "max_tokens: int = 16",
            "max_new_tokens: int = 16",
            "Params",
            "no field max_tokens",
        ),
        ("vllm.app", "state.online_renderer =", "state.renderer =", "state.online_renderer", "no longer assigns"),
        ("vllm.app", '"vllm:prompt_tokens"', '"vllm:prompt_tokens_v2"', "", ""),
        ("vllm.app", '"vllm:prompt_tokens"', '"vllm:input_tokens"', "vllm:prompt_tokens", "no longer contains"),
    ],
)
def test_a_doctored_release_fails_naming_the_release_and_the_symbol(module, old, new, symbol, says):
    found = compat_check.problems("0.34.0", doctored(module, old, new), TABLE)
    if not symbol:  # a change the plugin does not care about (the metric name still contains the text)
        assert found == []
        return
    assert found and all(problem.startswith("vLLM 0.34.0: ") for problem in found), found
    assert any(f".{symbol}: " in problem and says in problem for problem in found), found
    assert all("(needed by vllm_plugin/" in problem for problem in found)


def test_a_missing_module_is_named():
    found = compat_check.problems("0.33.0", Sources({k: v for k, v in RELEASE.items() if k != "vllm.app"}), TABLE)
    gone = "module vllm.app is gone (needed by vllm_plugin/"
    assert found == [
        f"vLLM 0.33.0: vllm.app.state.online_renderer: {gone}rendering.render_prefix_query)",
        f"vLLM 0.33.0: vllm.app.vllm:prompt_tokens: {gone}engine_rates.SAMPLES)",
    ]


def test_an_entry_limited_to_some_releases_is_checked_on_those_only():
    entry = Member(
        "vllm.v1.engine.core", "EngineCore.resolver", "rendering._disabled_thinking_effort", ((0, 33), (999, 0))
    )
    assert compat_check.problems("0.32.0", Sources(RELEASE), (entry,)) == []
    assert (
        "vLLM 0.33.0: vllm.v1.engine.core.EngineCore.resolver"
        in compat_check.problems("0.33.0", Sources(RELEASE), (entry,))[0]
    )


def test_a_property_is_not_a_callable_method():
    found = compat_check.problems("0.34.0", Sources(RELEASE), (Call("vllm.v1.engine.core", "EngineCore.label", "x"),))
    assert found and "no longer a method" in found[0]
