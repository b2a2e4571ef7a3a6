"""Open fedsyn's pages in headless Chromium: the DOM it renders and a screenshot (issue 64).

Usage: python -m benchmarks.page_screenshots --report RUN_DIR --ledger STATE_DIR [--allow-list FILE]
       [--audit-dir DIR] [--out docs]
Writes OUT/report_page.png (``fedsyn report RUN_DIR``) and OUT/ledger_page.png (``fedsyn ledger
STATE_DIR --html``), each the top of the page at 1200 px wide, as a reader first sees it.

The browser: ``$FEDSYN_CHROMIUM``, else the first of ``chromium-headless-shell``, ``chromium``,
``chromium-browser``, ``google-chrome`` on PATH (Debian: ``apt-get install chromium-headless-shell``;
PyPI ships none). Its own command line does the work (``--screenshot``, ``--dump-dom``): no driver
library, and nothing is fetched (the pages have no script and no link out).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")


def find_browser() -> str | None:
    """The headless Chromium to use (``$FEDSYN_CHROMIUM`` or the first of ``BROWSERS`` on PATH), or None."""
    return os.environ.get("FEDSYN_CHROMIUM") or next(filter(None, map(shutil.which, BROWSERS)), None)


def _browse(browser: str, page: Path, *flags: str, timeout: float = 60) -> subprocess.CompletedProcess:
    # a fresh profile per call and no network: the page must stand on its own
    with tempfile.TemporaryDirectory(prefix="fedsyn-chromium-") as profile:
        return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                               f"--user-data-dir={profile}", "--proxy-server=127.0.0.1:9", "--no-first-run", *flags,
                               page.resolve().as_uri()], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, check=False)


def screenshot(browser: str, page: Path, png: Path, size: tuple[int, int] = (1200, 900)) -> Path:
    """Render ``page`` at ``size`` (width, height px) and write the viewport to ``png``; raises
    ``RuntimeError`` with the browser's output when it wrote nothing."""
    png.parent.mkdir(parents=True, exist_ok=True)
    png.unlink(missing_ok=True)
    res = _browse(browser, page, f"--screenshot={png.resolve()}", f"--window-size={size[0]},{size[1]}")
    if not png.exists():
        raise RuntimeError(f"{browser} wrote no screenshot of {page}: {res.stderr[-2000:]}")
    return png


def rendered_dom(browser: str, page: Path) -> str:
    """The DOM the browser built from ``page``, serialised (``--dump-dom``)."""
    res = _browse(browser, page, "--dump-dom")
    if res.returncode != 0 or "<html" not in res.stdout:
        raise RuntimeError(f"{browser} did not render {page}: {res.stderr[-2000:]}")
    return res.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", required=True, help="a run's folder (fedsyn report RUN_DIR)")
    ap.add_argument("--ledger", required=True, help="a node's state-dir (fedsyn ledger STATE_DIR --html)")
    ap.add_argument("--allow-list", default=None)
    ap.add_argument("--audit-dir", default=None)
    ap.add_argument("--out", default="docs")
    ap.add_argument("--height", type=int, default=1500, help="the screenshot's height in px")
    args = ap.parse_args()
    browser = find_browser()
    if browser is None:
        print("no headless Chromium: apt-get install chromium-headless-shell, or set FEDSYN_CHROMIUM", file=sys.stderr)
        return 1
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        pages = {"report_page": Path(tmp) / "report.html", "ledger_page": Path(tmp) / "ledger.html"}
        fedsyn = Path(sys.executable).parent / "fedsyn"
        subprocess.run([fedsyn, "report", args.report, "--out", pages["report_page"]], check=True)
        ledger = [fedsyn, "ledger", args.ledger, "--html", pages["ledger_page"]]
        ledger += ["--allow-list", args.allow_list] if args.allow_list else []
        ledger += ["--audit-dir", args.audit_dir] if args.audit_dir else []
        subprocess.run(ledger, check=True)
        for name, page in pages.items():
            print(screenshot(browser, page, out / f"{name}.png", (1200, args.height)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
