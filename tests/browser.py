"""A real headless Chromium for the report tests (pytest plugin).

Fixture ``chromium`` (session): the path of Debian's ``chromium``. Where it is missing and we
are root with apt-get (a fresh Debian CI machine), the ``chromium`` package is installed with
apt-get, as the PostgreSQL tests install ``postgresql``; if that fails the test fails with
apt's output. Without root or apt-get the tests are skipped. Playwright (a test dependency)
drives it with ``executable_path``: it never downloads a browser of its own.

``open_page(chromium, html_path, screenshot_path)`` loads a file the way a person opens a
report, with every request that is not the file itself recorded and refused (the machine has
no network; the report must not need one), and returns what the page did: console errors,
page errors, the refused requests, and for each ``[data-figure]`` container whether plotly
drew an SVG in it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
from postgres_server import apt_get

# as the machine's own browser check starts it: without these it calls home at start-up
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]
LOCAL_SCHEMES = ("file:", "data:", "blob:", "about:")


@dataclasses.dataclass
class PageRun:
    console_errors: list[str]
    page_errors: list[str]
    network_requests: list[str]
    figures: dict[str, bool]  # data-figure key -> plotly drew an SVG there
    notes: list[str]  # figures not drawn, as the page says why
    title: str
    overflow_px: int  # how far the page is wider than the window (0: it fits)


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="session")
def chromium() -> str:
    found = find_chromium()
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("no chromium, and not root with apt-get to install it")
    log: list[str] = []
    install = ["install", "-y", "--no-install-recommends", "chromium"]
    ok = apt_get(install, log) or (apt_get(["update"], log) and apt_get(install, log))
    found = find_chromium()
    if not ok or not found:
        pytest.fail("apt-get install chromium failed:\n" + "\n".join(log)[-4000:])
    return found


def open_page(chromium: str, html_path: Path, screenshot_path: Path,
              width_px: int = 1280) -> PageRun:
    """Load `html_path` in headless Chromium in a `width_px` window, wait for plotly,
    screenshot the whole page."""
    from playwright.sync_api import sync_playwright

    console, errors, requests = [], [], []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True,
                                             args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width_px, "height": 900})
            page.on("console", lambda msg: console.append(msg.text)
                    if msg.type == "error" else None)
            page.on("pageerror", lambda err: errors.append(str(err)))

            def refuse_remote(route) -> None:
                url = route.request.url
                if url.startswith(LOCAL_SCHEMES):
                    route.continue_()
                else:
                    requests.append(url)
                    route.abort()

            page.route("**/*", refuse_remote)
            page.goto(html_path.resolve().as_uri(), wait_until="load", timeout=60_000)
            page.wait_for_timeout(500)  # plotly draws on load; let responsive resizes settle
            figures = page.evaluate("""() => Object.fromEntries(
                [...document.querySelectorAll('[data-figure]')].map(div =>
                    [div.dataset.figure, !!div.querySelector('.js-plotly-plot svg.main-svg')]))""")
            notes = page.evaluate("() => [...document.querySelectorAll('p.note')]"
                                  ".map(p => p.textContent)")
            overflow = page.evaluate("() => document.documentElement.scrollWidth - "
                                     "window.innerWidth")
            page.screenshot(path=str(screenshot_path), full_page=True)
            title = page.title()
        finally:
            browser.close()
    return PageRun(console, errors, requests, figures, notes, title, overflow)
