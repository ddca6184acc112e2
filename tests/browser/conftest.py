"""Headless Chromium driven by Playwright, and a kvgate on a background event loop.

The browser is Debian's `chromium` package (/usr/bin/chromium, or $KVGATE_CHROMIUM):
Playwright's own browser download is never used (it cannot work offline). Where the
binary is missing and the tests run as root with apt-get, they install the package
(.ci/run installs it up front); anywhere else they skip, saying what to install.
One browser per module (a fresh profile in a temporary directory); each test gets its
own page, and fails if the page logged a console error or threw.

Playwright's sync API drives the browser from the test's thread; kvgate and its fake
replicas (tests/ui/stack.py) run on an asyncio loop in a background thread, which the
test calls into with `ServerLoop.run`.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.apt_install import apt_install
from tests.ui.stack import Stack, start_stack

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str:
    """Debian's Chromium, installed if missing and we may; skips the module when neither."""
    path = os.environ.get("KVGATE_CHROMIUM", "/usr/bin/chromium")
    if not Path(path).exists():
        why = apt_install("chromium")
        if not Path(path).exists():
            pytest.skip(
                f"Chromium is not at {path} and could not be installed ({why or 'the package has no such binary'}); "
                "install Debian's `chromium` package or set KVGATE_CHROMIUM to a Chromium binary"
            )
    return path


class ServerLoop:
    """An asyncio loop in a daemon thread: `run(coro)` runs a coroutine on it and returns its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvgate-test-loop", daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro):
        """Start `coro` on the loop; a concurrent.futures.Future of its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def server_loop() -> Iterator[ServerLoop]:
    loop = ServerLoop()
    yield loop
    loop.close()


@pytest.fixture
def stack(server_loop: ServerLoop) -> Iterator[Stack]:
    made = server_loop.run(start_stack())
    yield made
    server_loop.run(made.close())


@pytest.fixture(scope="module")
def browser_context(tmp_path_factory):
    path = chromium_path()
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="Playwright is in the test extra: pip install -e '.[test]'"
    )
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=path,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 860},
        )
        yield context
        context.close()


class PageErrors:
    """What a page logged as an error: console errors and uncaught exceptions."""

    def __init__(self) -> None:
        self.console: list[str] = []
        self.thrown: list[str] = []
        self.allowed: tuple[str, ...] = ()  # console text a test expects (a failed fetch while kvgate is down)

    def unexpected(self) -> list[str]:
        return [m for m in self.console if not any(a in m for a in self.allowed)] + self.thrown


@pytest.fixture
def page(browser_context, stack):
    """A new tab on this test's kvgate (`stack`: set up before the tab and stopped after it
    closes, so the tab never polls a stopped kvgate); the test fails if it logged a console
    error or threw (`errors`)."""
    tab = browser_context.new_page()
    errors = PageErrors()
    tab.on("console", lambda message: message.type == "error" and errors.console.append(message.text))
    tab.on("pageerror", lambda error: errors.thrown.append(str(error)))
    tab.errors = errors
    yield tab
    tab.close()
    assert errors.unexpected() == [], "the page logged errors"
