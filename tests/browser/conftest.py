"""Browser tests: Debian's Chromium (``apt-get install chromium``), driven by Playwright
through its executable path (never a browser Playwright downloads), against a real
``gpufleet server`` and real workers on loopback.

Screenshots of each page go to ``GPUFLEET_SCREENSHOTS`` (default ``artifacts/screenshots``),
which CI keeps as artifacts.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Fleet, fleet

__all__ = ["SHOTS", "fleet"]

CHROMIUM = os.environ.get("GPUFLEET_CHROMIUM") or shutil.which("chromium")
SHOTS = Path(os.environ.get("GPUFLEET_SCREENSHOTS", "artifacts/screenshots"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).parent.name == "browser":
            item.add_marker(pytest.mark.browser)


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    if not CHROMIUM:
        if os.environ.get("CI"):
            pytest.fail("Debian's chromium is not installed: apt-get install chromium")
        pytest.skip("no Chromium on this machine (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        # --no-sandbox: CI runs as root, where Chromium's sandbox cannot start
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            chromium.close()


class Watched:
    """A page, with what it said: script errors, dialogs (an alert is a script that ran),
    and console errors (a Content-Security-Policy refusal shows there)."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.console: list[str] = []
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on("dialog", self._dialog)
        page.on("console", lambda m: m.type == "error" and self.console.append(m.text))

    def _dialog(self, dialog: Any) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def shot(self, name: str) -> None:
        SHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


@pytest.fixture
def watched(browser: Any) -> Iterator[Watched]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(15_000)
    try:
        yield Watched(context.new_page())
    finally:
        context.close()


def sign_in(w: Watched, fleet: Fleet, token: str) -> None:
    w.page.goto(fleet.url + "/")
    w.page.fill("#token", token)
    w.page.click("button[type=submit]")
    w.page.wait_for_selector("#nav:not([hidden])")
