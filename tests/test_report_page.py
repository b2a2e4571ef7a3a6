"""``fedsyn report RUN_DIR`` (issue 64): one self-contained page of a run, its structure checked."""

from __future__ import annotations

import json

import pytest

from fedsyn_server.report_page import SECTIONS, report_page
from tests.test_ledger_page import _Page


def _run(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = tmp_path / "run-1"
    (run / "plots").mkdir(parents=True)
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    fig.savefig(run / "plots" / "votes_per_code.png")
    plt.close(fig)
    (run / "privacy_report.json").write_text(json.dumps({
        "private": True, "warning": None, "unit": "one record of one node",
        "nodes": [{"node_id": 7, "tier": "weak", "epsilon_budget": 8.0, "epsilon_spent": 7.99, "epsilon_pld": 7.98,
                   "composed_delta": 1e-5, "releases": [{}, {}], "failures": [], "source": "node ledger"}],
        "writers": {"why": "half and half", "pool": {"topic=x": {"finetuned": 3, "pretrained": 3}},
                    "kept_share": {"topic=x": {"finetuned": 0.75, "pretrained": 0.25}}}}))
    (run / "evaluation.json").write_text(json.dumps({
        "utility": {"topic": {"accuracy": 0.81, "macro_f1": 0.79, "label_fidelity": 0.83, "n_train": 58, "n_test": 36}},
        "alignment": {"frechet_distance": 1.1, "knn_precision": 0.93, "knn_recall": 0.97, "mauve": {"mean": 0.95}}}))
    (run / "synthetic.jsonl").write_text("".join(json.dumps({"text": t, "control_code": c}) + "\n" for t, c in [
        ("a <b>bold</b> claim about x", "topic=x"), ("second", "topic=x"), ("third", "topic=x"), ("fourth", "topic=x"),
        ("one about y " * 100, "topic=y")]))
    return run


def test_the_run_page_has_every_section_inline_and_escaped(tmp_path, capsys):
    from fedsyn_server.cli import main

    run = _run(tmp_path)
    assert main(["report", str(run)]) == 0 and "wrote" in capsys.readouterr().out
    html = (run / "report.html").read_text()
    page = _Page()
    page.feed(html)
    assert set(SECTIONS) <= set(page.ids) and "script" not in page.tags and "b" not in page.tags
    assert len(page.links) == 1 and page.links[0].startswith("data:image/png;base64,")
    text = " ".join(page.text)
    for expected in ("7.99", "0.81", "0.95", "half and half", "0.75", "a <b>bold</b> claim about x", "topic=y"):
        assert expected in text, expected
    assert "fourth" not in text  # three per code
    assert "…" in text  # a long text is cut


def test_a_run_without_its_files_still_gets_a_page_and_a_missing_folder_is_named(tmp_path):
    page = _Page()
    page.feed(report_page(tmp_path))
    text = " ".join(page.text)
    assert set(SECTIONS) <= set(page.ids) and "No privacy_report.json" in text and "No synthetic.jsonl" in text
    with pytest.raises(FileNotFoundError, match="not a run"):
        report_page(tmp_path / "missing")
