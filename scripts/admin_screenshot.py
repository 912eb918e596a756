#!/usr/bin/env python3
"""Screenshot an admin page of a running demo (for the docs).

    scripts/demo &                      # in another terminal
    .venv/bin/python scripts/admin_screenshot.py failedworkitem docs/img/failed-page.png
    .venv/bin/python scripts/admin_screenshot.py workitem docs/img/workitems-list-1280.png \\
        --width 1280 --height 800

Logs in as admin/admin with Debian's chromium driven by Playwright. Django's
navigation sidebar is open (as it is for a visitor who never closed it), or
closed with ``--sidebar closed``.
"""

from __future__ import annotations

import argparse

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
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("model", help="the admin page's model name, e.g. failedworkitem")
    parser.add_argument("out", help="the PNG to write")
    parser.add_argument("base", nargs="?", default="http://127.0.0.1:8000")
    parser.add_argument("--width", type=int, default=1600, help="window width in px")
    parser.add_argument("--height", type=int, default=560, help="window height in px")
    parser.add_argument("--sidebar", choices=["open", "closed"], default="open")
    args = parser.parse_args()
    if args.width < 320 or args.height < 200:
        parser.error("--width must be at least 320 and --height at least 200 px")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        page = browser.new_page(viewport={"width": args.width, "height": args.height})
        # Django's nav_sidebar.js reads this before the page is drawn.
        page.add_init_script(
            "localStorage.setItem('django.admin.navSidebarIsOpen', "
            f"'{'true' if args.sidebar == 'open' else 'false'}')"
        )
        page.goto(f"{args.base}/admin/django_dbworker/{args.model}/")
        if page.query_selector("#id_username"):
            page.fill("#id_username", "admin")
            page.fill("#id_password", "admin")
            page.click("input[type=submit]")
            page.wait_for_selector("#content")
        page.screenshot(path=args.out, full_page=False)
        browser.close()


if __name__ == "__main__":
    main()
