#!/usr/bin/env python3
"""Screenshot an admin page of a running demo (for the README).

    scripts/demo &                      # in another terminal
    .venv/bin/python scripts/admin_screenshot.py failedworkitem docs/img/failed-page.png

Logs in as admin/admin with Debian's chromium driven by Playwright.
"""

from __future__ import annotations

import sys

from playwright.sync_api import sync_playwright

ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def main() -> None:
    model, out = sys.argv[1], sys.argv[2]
    base = sys.argv[3] if len(sys.argv) > 3 else "http://127.0.0.1:8000"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 560})
        page.goto(f"{base}/admin/django_dbworker/{model}/")
        if page.query_selector("#id_username"):
            page.fill("#id_username", "admin")
            page.fill("#id_password", "admin")
            page.click("input[type=submit]")
            page.wait_for_selector("#content")
        page.screenshot(path=out, full_page=False)
        browser.close()


if __name__ == "__main__":
    main()
