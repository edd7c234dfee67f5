"""A page opened in headless Chromium, offline: ``with offline_page(path) as (page, errors, requests):`` collects
the page's script errors and every request that is not a file: or data: URL (both must stay empty); skips where
playwright or chromium is missing (see tests/viz/BROWSER_SETUP.md)."""

import os
from contextlib import contextmanager

import pytest


@contextmanager
def offline_page(path):
    pw = pytest.importorskip("playwright.sync_api")
    exe = os.environ.get("STORYLENS_CHROMIUM", "/usr/bin/chromium")
    if not os.path.isfile(exe):
        pytest.skip("chromium is not installed (see tests/viz/BROWSER_SETUP.md)")
    with pw.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        page = browser.new_page()
        errors, requests = [], []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: None if r.url.startswith(("file:", "data:")) else requests.append(r.url))
        page.goto(path.as_uri())
        yield page, errors, requests
        browser.close()
