"""Headless Chromium for the page tests: Debian's `chromium`, driven by Playwright.

A test module imports this first; without the browser the whole module is skipped. Its
fixtures are a browser per module and a page that fails the test on any script error.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM = next((p for p in ("/usr/bin/chromium", shutil.which("chromium") or "") if p
                 and Path(p).exists()), None)
if CHROMIUM is None:
    pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)",
                allow_module_level=True)

from playwright.sync_api import Page, sync_playwright  # noqa: E402


@pytest.fixture(scope="module", name="browser")
def browser_fixture() -> Iterator[Any]:
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        yield chromium
        chromium.close()


def open_page(browser: Any, width: int, height: int, timeout_ms: int) -> Iterator[Page]:
    """A page of ``width`` x ``height``; after the test, any script error it raised fails it."""
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    page.set_default_timeout(timeout_ms)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert not errors, errors


def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


__all__ = ["ARTIFACTS", "CHROMIUM", "browser_fixture", "open_page", "shot"]
