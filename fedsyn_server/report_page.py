"""``fedsyn report RUN_DIR``: one self-contained page of a run (issue 64), for the researcher who ran it.

From the run's own outputs: the privacy report per site (``privacy_report.json``), the evaluation
(``evaluation.json``) with the run's plots inline (``plots/*.png``), the writers' shares (which weights
wrote the kept texts, per code) and a sample of the synthetic texts per code (``synthetic.jsonl``).
Files a run did not write (a run without evaluation, a table run) leave their section saying so.
Built with ``common.html_page``: no script, nothing fetched, every value escaped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.html_page import document, escape, image, number, png_uri, section, table

SECTIONS = ("privacy", "evaluation", "plots", "writers", "samples")
SAMPLES_PER_CODE = 3
SAMPLE_CHARS = 400


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _privacy(report: dict[str, Any] | None) -> str:
    if report is None:
        return '<p class="muted">No privacy_report.json in this run.</p>'
    head = f'<p class="warn">{escape(report["warning"])}</p>' if report.get("warning") else ""
    rows = [[escape(n.get("node_id", "")), escape(n.get("tier", "")), number(n.get("epsilon_budget")),
             number(n.get("epsilon_spent")), number(n.get("epsilon_pld")),
             number(n.get("composed_delta") or n.get("delta"), 3),
             escape(len(n.get("releases", []))), escape(len(n.get("failures", []))), escape(n.get("source", ""))]
            for n in report.get("nodes", [])]
    return (head + f'<p>Unit of privacy: {escape(report.get("unit", ""))}.</p>'
            + table(("site", "tier", "budget epsilon", "spent (basic)", "spent (PLD)", "at delta", "releases",
                     "failures", "from"), rows, numeric=(2, 3, 4, 5, 6, 7)))


def _evaluation(evaluation: dict[str, Any] | None) -> str:
    if evaluation is None:
        return ('<p class="muted">No evaluation.json in this run (no held-out records, or <code>fedsyn evaluate</code> '
                "not run).</p>")
    rows = [[escape(column), number(m.get("accuracy")), number(m.get("macro_f1")), number(m.get("label_fidelity")),
             escape(m.get("n_train", "")), escape(m.get("n_test", ""))]
            for column, m in (evaluation.get("utility") or {}).items() if isinstance(m, dict)]
    out = table(("control column", "accuracy (train on synthetic, test on real)", "macro F1", "label fidelity",
                 "synthetic", "real"), rows, numeric=(1, 2, 3, 4, 5)) if rows else ""
    align = evaluation.get("alignment") or {}
    mauve = align.get("mauve")
    out += table(("Fréchet distance", "kNN precision", "kNN recall", "MAUVE"),
                 [[number(align.get("frechet_distance")), number(align.get("knn_precision")),
                   number(align.get("knn_recall")), number(mauve.get("mean") if isinstance(mauve, dict) else mauve)]],
                 numeric=(0, 1, 2, 3)) if align else ""
    return out or '<p class="muted">The evaluation holds no utility or alignment figures.</p>'


def _writers(writers: dict[str, Any] | None) -> str:
    if not writers or not writers.get("kept_share"):
        return '<p class="muted">One writer: no shares to show.</p>'
    rows = []
    for code, shares in sorted(writers["kept_share"].items()):
        pool = (writers.get("pool") or {}).get(code, {})
        rows.append([escape(code)] + [f"{number(shares.get(w, 0.0), 3)} (pool {escape(pool.get(w, 0))})"
                                      for w in ("finetuned", "pretrained")])
    return (f"<p>{escape(writers.get('why', ''))}</p>"
            + table(("code", "kept share: finetuned (pool)", "kept share: pretrained (pool)"), rows))


def _samples(run_dir: Path) -> str:
    path = run_dir / "synthetic.jsonl"
    if not path.exists():
        return '<p class="muted">No synthetic.jsonl in this run.</p>'
    by_code: dict[str, list[str]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        texts = by_code.setdefault(str(row.get("control_code", "")), [])
        if len(texts) < SAMPLES_PER_CODE:
            texts.append(str(row.get("text", "")))
    return "\n".join(f"<h3>{escape(code)}</h3>" + "".join(
        f"<blockquote>{escape(t[:SAMPLE_CHARS])}{'…' if len(t) > SAMPLE_CHARS else ''}</blockquote>" for t in texts)
        for code, texts in sorted(by_code.items())) or "<p>No texts.</p>"


def report_page(run_dir: str | Path) -> str:
    """The page of the run in ``run_dir``: one HTML document with every section of ``SECTIONS``."""
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"{run} is not a run's folder (fedsyn run writes one per run under out-dir)")
    report = _json(run / "privacy_report.json")
    plots = sorted((run / "plots").glob("*.png")) if (run / "plots").is_dir() else []
    parts = [f"<h1>fedsyn run {escape(run.name)}</h1>",
             f'<p class="muted">{escape(run)}: written by <code>fedsyn report</code> from the run\'s outputs.</p>',
             section("privacy", "Privacy, per site", _privacy(report)),
             section("evaluation", "Evaluation", _evaluation(_json(run / "evaluation.json"))),
             section("plots", "Plots", "\n".join(image(png_uri(p.read_bytes()), p.stem.replace("_", " "))
                                                 for p in plots) or '<p class="muted">No plots.</p>'),
             section("writers", "Writers' shares", _writers((report or {}).get("writers"))),
             section("samples", f"Synthetic texts, up to {SAMPLES_PER_CODE} per code", _samples(run))]
    return document(f"fedsyn run {run.name}", parts)
