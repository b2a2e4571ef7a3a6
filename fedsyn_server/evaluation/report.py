"""``format_report``: an evaluation result as a plain-text table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "  ") -> list[str]:
    cells = [[str(h) for h in header]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    # First column left-aligned (names), the numbers right-aligned.
    return [
        indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
        for row in cells
    ]


def format_report(result: dict[str, Any]) -> str:
    """A plain-text report of an ``evaluate_sets`` / ``evaluate_files`` result: aligned tables."""
    lines = [
        f"synthetic: {result.get('synthetic_path', '(in memory)')} ({result['n_synthetic']} records)",
        f"real:      {result.get('real_path', '(in memory)')} ({result['n_real']} records)",
        f"embedder:  {result['embedder']}",
        "",
        f"Downstream utility (train on synthetic, test on real; {result['classifier']})",
    ]
    lines += _table(
        ["label", "accuracy", "macro_f1", "label_fidelity", "n_train", "n_test", "classes(train/test)"],
        [[name, u["accuracy"], u["macro_f1"], u.get("label_fidelity"), u["n_train"], u["n_test"],
          f"{u['n_classes_train']}/{u['n_classes_test']}"] for name, u in result["utility"].items()],
    )
    lines += [f"  WARNING ({name}): {w}" for name, u in result["utility"].items() for w in u.get("warnings", [])]
    align = result["alignment"]
    m = align["mauve"]
    lines += ["", "Distribution alignment (sentence embeddings)"]
    lines += _table(
        ["metric", "value"],
        [["Frechet distance", align["frechet_distance"]],
         [f"k-NN precision (k={align['knn_k']})", align["knn_precision"]],
         [f"k-NN recall (k={align['knn_k']})", align["knn_recall"]],
         [f"MAUVE ({len(m['per_seed'])} seeds)" if m else "MAUVE",
          f"{m['mean']:.3f} +/- {m['std']:.3f}" if m else "-"]],
    )
    lines += [f"  note: {n}" for n in align.get("notes", [])]
    alloc = result["allocation"]
    lines += ["", "Allocation (share of records per code)"]
    lines += _table(
        ["code", "synthetic", "real", "abs_error"],
        [[code, v["synthetic_share"], v["real_share"], v["abs_error"]] for code, v in alloc["per_code"].items()],
    )
    lines.append(f"  total variation {alloc['total_variation']:.3f}, max abs error {alloc['max_abs_error']:.3f}")
    return "\n".join(lines)

