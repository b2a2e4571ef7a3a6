"""``fedsyn ledger STATE_DIR --html PAGE`` (issue 64): one self-contained page of what a node released,
its structure checked (every section, the plot inline, nothing fetched, every value escaped)."""

from __future__ import annotations

import json
import math
from html.parser import HTMLParser

from fedsyn_client.ledger import PrivacyLedger, Release, set_budget
from fedsyn_client.ledger_page import SECTIONS


class _Page(HTMLParser):
    """The page's ids, tags and every src/href it names."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.tags: list[str] = []
        self.links: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for name, value in attrs:
            if name == "id":
                self.ids.append(value)
            if name in ("src", "href"):
                self.links.append(value)

    def handle_data(self, data):
        self.text.append(data)


def _node(tmp_path):
    ledger = PrivacyLedger.open(tmp_path / "state", 8.0)
    for rnd, (phase, eps, public) in enumerate([("profile", 2.0, {"sigma": 1.99, "sensitivity": 1.0}),
                                                 ("vote", 3.0, {"sigma": 1.5, "sensitivity": 2.0,
                                                                "histogram": "knn-vote"})], start=1):
        rel = Release(phase=phase, mechanism="gaussian", epsilon=eps, delta=1e-5, run_id="run-<script>x",
                      round=rnd, public=public)
        ledger.confirm(ledger.reserve(rel, 8.0))
    failed = ledger.reserve(Release(phase="vote", mechanism="gaussian", epsilon=1.0, delta=1e-5, run_id="run-b",
                                    round=1, public={"sigma": 2.0, "sensitivity": 2.0}), 8.0)
    ledger.fail(failed, "RuntimeError after the reservation")
    set_budget(tmp_path / "state", 10.0, "the board allowed more")
    allow = tmp_path / "allow-list.txt"
    allow.write_text("# FABs this node runs\n" + "ab" * 32 + "  # /srv/review/fedsyn (v1) approved 2026-11-29; "
                     "reviewed by Dr. <b>Lee</b>\n")
    audit = tmp_path / "audit"
    audit.mkdir()
    (audit / "node-1.jsonl").write_text("\n".join(json.dumps(x) for x in [
        {"message_type": "query.vote", "error": {"code": 1004, "reason": "refused: policy: embedder"}},
        {"message_type": "query.vote", "error": {"code": 1004, "reason": "refused: policy: embedder"}},
        {"message_type": "query.profile", "records": {}}]) + "\n")
    return allow, audit


def test_the_page_has_every_section_inline_and_escaped(tmp_path, capsys):
    from fedsyn_server.cli import main

    allow, audit = _node(tmp_path)
    page = tmp_path / "ledger.html"
    assert main(["ledger", str(tmp_path / "state"), "--html", str(page), "--allow-list", str(allow),
                 "--audit-dir", str(audit)]) == 0
    assert "wrote" in capsys.readouterr().out
    html = page.read_text()
    parsed = _Page()
    parsed.feed(html)
    assert set(SECTIONS) <= set(parsed.ids)
    assert "script" not in parsed.tags and "<script>x" not in html  # a run id's markup is text, escaped
    assert parsed.links and all(link.startswith("data:image/png;base64,") for link in parsed.links)  # offline
    text = " ".join(parsed.text)
    for expected in ("run-<script>x", "knn-vote", "1.99", "refused: policy: embedder", "ab" * 32,
                     "reviewed by Dr. <b>Lee</b>", "the board allowed more", "vote 1"):
        assert expected in text, expected
    assert text.count("refused: policy: embedder") == 1 and "2" in text  # counted once, twice seen


def test_a_node_without_releases_allow_list_or_audit_folder_still_gets_its_page(tmp_path):
    from fedsyn_client.ledger_page import ledger_page

    summary = PrivacyLedger.open(tmp_path, math.inf).summary()
    parsed = _Page()
    parsed.feed(ledger_page(summary))
    assert set(SECTIONS) <= set(parsed.ids) and not parsed.links
    text = " ".join(parsed.text)
    assert "Nothing released yet" in text and "No allow-list given" in text and "No audit folder given" in text
