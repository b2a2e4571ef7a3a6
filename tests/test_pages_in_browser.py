"""Issue 64: the ledger's page and the run's page open in a real browser, offline.

Headless Chromium renders each page from a file with the network closed (a proxy nobody listens
on): the DOM it builds has every section, every image decoded from the page itself, and the
screenshot is not blank. PyPI ships no Chromium, so this runs where one is installed (Debian:
``apt-get install chromium-headless-shell``, or ``FEDSYN_CHROMIUM``) and is skipped elsewhere;
CI checks the pages' HTML structure in tests/test_ledger_page.py and tests/test_report_page.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.page_screenshots import find_browser, rendered_dom, screenshot
from fedsyn_client.ledger_page import SECTIONS as LEDGER_SECTIONS
from fedsyn_server.report_page import SECTIONS as REPORT_SECTIONS
from tests.test_ledger_page import _node, _Page
from tests.test_report_page import _run

BROWSER = find_browser()
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no headless Chromium here (apt-get install "
                                                        "chromium-headless-shell, or set FEDSYN_CHROMIUM)")


def _not_blank(png: Path) -> tuple[float, int]:
    """(share of pixels that are not the page's background, distinct colours) of a screenshot."""
    from PIL import Image

    image = Image.open(png).convert("RGB")
    colours = image.getcolors(maxcolors=1 << 20) or []
    background = max(colours)[1]
    return 1 - max(colours)[0] / (image.width * image.height), len({c for _, c in colours if c != background})


def _pages(tmp_path: Path) -> dict[str, tuple[Path, tuple[str, ...], int]]:
    from fedsyn_server.cli import main  # the `fedsyn` command: node and server subcommands

    allow, audit = _node(tmp_path)
    ledger, report = tmp_path / "ledger.html", tmp_path / "report.html"
    assert main(["ledger", str(tmp_path / "state"), "--html", str(ledger), "--allow-list", str(allow),
                      "--audit-dir", str(audit)]) == 0
    assert main(["report", str(_run(tmp_path)), "--out", str(report)]) == 0
    return {"ledger": (ledger, LEDGER_SECTIONS, 1), "report": (report, REPORT_SECTIONS, 1)}


@pytest.mark.parametrize("which", ["ledger", "report"])
def test_the_page_renders_offline_in_headless_chromium_with_every_section_and_its_images(tmp_path, which):
    assert BROWSER is not None
    page, sections, images = _pages(tmp_path)[which]
    dom = _Page()
    dom.feed(rendered_dom(BROWSER, page))
    assert set(sections) <= set(dom.ids), (sections, dom.ids)
    assert dom.tags.count("img") >= images and all(link.startswith("data:image/png;base64,") for link in dom.links)
    assert "script" not in dom.tags
    drawn, colours = _not_blank(screenshot(BROWSER, page, tmp_path / f"{which}.png"))
    assert drawn > 0.03 and colours > 20, (drawn, colours)  # text, tables and a plot, not an empty page


def test_a_blank_page_is_told_apart(tmp_path):
    """The screenshot check can fail: an empty page is all background."""
    assert BROWSER is not None
    empty = tmp_path / "empty.html"
    empty.write_text("<!doctype html><html><body></body></html>")
    drawn, colours = _not_blank(screenshot(BROWSER, empty, tmp_path / "empty.png"))
    assert drawn < 0.001 and colours == 0
