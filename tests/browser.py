"""Debian's Chromium driven by Playwright, for the viewer's tests: launched from the system's
binary (never a downloaded browser: ``playwright install`` needs a network), with its
background networking off; a page that records every request it would send off the machine
(and fails it) and every script error."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
INSTALL = "apt-get install -y --no-install-recommends chromium fonts-dejavu-core"


@contextmanager
def chromium() -> Iterator[Any]:
    """The browser; where Chromium is missing, a failure naming the command that installs it
    (never a skip: CI installs it, .ci/run)."""
    if shutil.which("chromium") is None and not Path(CHROMIUM).exists():
        pytest.fail(f"the viewer's browser tests need Debian's Chromium: {INSTALL}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--disable-background-networking", "--disable-component-update",
                  "--no-first-run", "--no-sandbox"],
        )  # fmt: skip
        try:
            yield browser
        finally:
            browser.close()


def open_page(browser: Any, url: str, allowed: str) -> tuple[Any, list[str], list[str]]:
    """A page of ``url`` that lets through only requests whose URL starts with ``allowed``
    (the file itself, or the server under test): the others are failed and listed, as are
    script errors."""
    page = browser.new_page(viewport={"width": 900, "height": 600})
    errors: list[str] = []
    off_machine: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))

    def route(request_route: Any) -> None:
        if request_route.request.url.startswith(allowed):
            request_route.continue_()
        else:
            off_machine.append(request_route.request.url)
            request_route.abort()

    page.route("**/*", route)
    page.goto(url)
    return page, errors, off_machine
