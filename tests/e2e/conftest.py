"""Browser fixtures: Debian's chromium driven by Playwright. A missing browser fails the test
with a clear message (these tests are part of the default suite: they must not silently skip)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"


def chromium_path() -> str:
    path = os.environ.get("GPUSCHED_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.fail("browser test needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium) "
                    "or GPUSCHED_CHROMIUM=/path/to/chromium; Playwright's own browser download is not used",
                    pytrace=False)
    return path


@pytest.fixture
async def browser():
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        pytest.fail("browser test needs the Python package playwright (pip install -e '.[test]')", pytrace=False)
    path = chromium_path()
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            await b.close()


@pytest.fixture
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
