"""``vllm.general_plugins`` entry point: add the probe UTILITY methods to ``EngineCore``.

vLLM loads general plugins in the API server, in every engine core and in every
worker, possibly more than once per process, and a forked engine core inherits
"plugins loaded" from its parent without calling ``register`` again. So
``register`` patches the ``EngineCore`` class itself, unconditionally (whatever
process it runs in) and idempotently (a second call changes nothing).

The API server reaches the methods with
``engine_client.engine_core.call_utility_all_async(KV_ANSWER_METHOD)``,
``(PREFIX_ANSWER_METHOD, token_ids, cache_salt, lora)`` and ``(RELEASE_METHOD, sessions)``
(which ends KV pins the retention connector holds, `pin_keeper`); the engine core runs them on
its main thread between two scheduler steps (``EngineCoreProc._handle_client_request``
dispatches UTILITY requests by ``getattr``), so they never enter a scheduler queue.

It also wraps ``EngineCore.step`` to time every scheduler step and note the tokens it
scheduled (`step_costs.StepLog`); the KV probe reports the marginal seconds per token
fitted from them (``token_sec``, `step_costs.marginal_token_sec`) and the share of
recent wall time spent in steps (``busy_share``, `kvgate.wire.busy_share`).
"""

from __future__ import annotations

import logging
import time

from kvgate.vllm_plugin.support import FIX, installed_vllm_version, unsupported_reason

logger = logging.getLogger(__name__)

KV_ANSWER_METHOD = "kvgate_kv_answer"
PREFIX_ANSWER_METHOD = "kvgate_prefix_answer"
RELEASE_METHOD = "kvgate_release_pins"
_PATCH_MARKER = "_kvgate_probes_installed"
_STEP_METHOD = "step"  # EngineCore's scheduler step, timed (`_timed_step`)
_STEP_LOG = "_kvgate_step_log"  # the engine core instance's StepLog
_SCHEDULED = "_kvgate_scheduled_tokens"  # tokens the scheduler's last schedule() scheduled


def _kv_answer(self) -> dict:
    from kvgate.vllm_plugin.engine_probes import kv_answer
    from kvgate.vllm_plugin.step_costs import marginal_token_sec

    result = kv_answer(self)
    log = getattr(self, _STEP_LOG, None)
    if log is not None and "error" not in result:
        result["token_sec"] = marginal_token_sec(log.steps)
        result["busy_share"] = log.busy.share(time.perf_counter())
    return result


def _watch_schedule(scheduler) -> None:
    """Wrap this scheduler's ``schedule`` (on the instance) to note the tokens it scheduled."""
    schedule = scheduler.schedule

    def noting_schedule(*args, **kwargs):
        output = schedule(*args, **kwargs)
        setattr(scheduler, _SCHEDULED, int(getattr(output, "total_num_scheduled_tokens", 0) or 0))
        return output

    scheduler.schedule = noting_schedule


def _timed_step(step):
    """``EngineCore.step``, timed: each step's seconds and scheduled tokens go to the
    instance's StepLog (made, and its scheduler watched, on the first step)."""

    def timed_step(self, *args, **kwargs):
        log = getattr(self, _STEP_LOG, None)
        if log is None:
            from kvgate.vllm_plugin.step_costs import StepLog, step_sink_from_env

            log = StepLog(sink=step_sink_from_env())
            setattr(self, _STEP_LOG, log)
            _watch_schedule(self.scheduler)
        setattr(self.scheduler, _SCHEDULED, 0)
        started = time.perf_counter()
        result = step(self, *args, **kwargs)
        ended = time.perf_counter()
        log.record(ended - started, getattr(self.scheduler, _SCHEDULED, 0), ended)
        return result

    return timed_step


# No annotations on purpose: vLLM converts UTILITY arguments whose annotation is a
# msgspec.Struct class, and these must stay plain lists/str/dicts.
def _prefix_answer(self, token_ids, cache_salt=None, lora=None) -> dict:
    from kvgate.vllm_plugin.engine_probes import prefix_answer

    return prefix_answer(self, token_ids, cache_salt, lora)


def _release_pins(self, sessions) -> dict:
    from kvgate.vllm_plugin.pin_keeper import release_answer

    return release_answer(self, sessions)


def install_probes(engine_core_cls: type) -> bool:
    """Add the probe methods to ``engine_core_cls``; False if they were already there."""
    if getattr(engine_core_cls, _PATCH_MARKER, False):
        return False
    setattr(engine_core_cls, KV_ANSWER_METHOD, _kv_answer)
    setattr(engine_core_cls, PREFIX_ANSWER_METHOD, _prefix_answer)
    setattr(engine_core_cls, RELEASE_METHOD, _release_pins)
    step = getattr(engine_core_cls, _STEP_METHOD, None)
    if callable(step):
        setattr(engine_core_cls, _STEP_METHOD, _timed_step(step))
    setattr(engine_core_cls, _PATCH_MARKER, True)
    return True


def register() -> None:
    """Entry point: patch ``vllm.v1.engine.core.EngineCore`` (safe to call repeatedly).

    On a vLLM release the plugin does not support it says so in vLLM's log (an error,
    once per process) and still installs what it can: the proxy then sees the probes
    answer, or fail with an error it reports, instead of a plugin that is silently absent.
    """
    _warn_if_unsupported()
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError as exc:  # a vLLM without the V1 engine core
        logger.error(
            "kvgate: cannot import vllm.v1.engine.core.EngineCore (%s); the probe "
            "endpoints will answer with an error. %s",
            exc,
            FIX,
        )
        return
    if install_probes(EngineCore):
        logger.info("kvgate: probe utility methods installed on EngineCore")


_version_checked = False


def _warn_if_unsupported() -> None:
    global _version_checked
    if _version_checked:
        return
    _version_checked = True
    reason = unsupported_reason(installed_vllm_version())
    if reason is not None:
        logger.error("kvgate: %s; the probe endpoints may fail or answer wrongly: %s", reason, FIX)
