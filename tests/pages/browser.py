"""Our HTML pages opened in a real headless browser (the system's Chromium, driven by Playwright):
what a user opening the file would see, console errors and any request leaving the page included."""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class OpenedPage:
    page: object  # playwright's Page
    console_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # every URL fetched besides the page itself


@contextmanager
def opened(path: Path):
    """The file at `path`, loaded offline; raises with the fix when Chromium is not installed."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    assert chromium, "the page tests need Chromium: `bash scripts/setup_env.sh --dev` installs it (apt-get install chromium)"
    url = Path(path).resolve().as_uri()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            found = OpenedPage(page)
            page.on("console", lambda m: found.console_errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: found.console_errors.append(str(e)))
            page.on("request", lambda r: found.requests.append(r.url) if r.url != url else None)
            page.goto(url, wait_until="load")
            yield found
        finally:
            browser.close()
