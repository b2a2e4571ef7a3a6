"""The power of ``fedsyn audit`` at its default settings (issue 63): how small a planted violation it
finds, measured on a weak node's real release path.

Plants, one at a time, a noise below the stated one (sigma times ``f``, the statement unchanged) and a
stated sensitivity below the real one (times ``f``, sigma calibrated to the stated), and counts in how
many of ``--reps`` audits of each release the audit fails it. Writes ``docs/audit_power.csv`` and
prints a table; the results are in docs/privacy.md#the-audit.

Usage: PYTHONPATH=. python -m benchmarks.audit_power [--reps 5] [--release profile --release vote:knn-vote]
"""

from __future__ import annotations

import argparse
import csv
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common import dp
from fedsyn_client import client_app, release
from fedsyn_client.privacy_audit import run_audit
from fedsyn_client.release import GaussianHistogram

FACTORS = (1.0, 0.97, 0.95, 0.93, 0.9, 0.8, 0.5)


@contextmanager
def planted(bug: str, f: float) -> Iterator[None]:
    """``bug`` ("sigma" or "sensitivity") at factor ``f`` on the node's release path while open."""
    original_release, original_class = release.gaussian_release, client_app.GaussianHistogram

    class Understated(GaussianHistogram):
        def __init__(self, histogram, compute, sensitivity, prepare=None):  # noqa: ANN001 - the class's own
            super().__init__(histogram, compute, sensitivity * f, prepare)

    if bug == "sigma":
        release.gaussian_release = lambda v, sigma, rng: dp.gaussian_release(v, sigma * f, rng)
    else:
        client_app.GaussianHistogram = Understated  # type: ignore[misc]  # the planted bug
    try:
        yield
    finally:
        release.gaussian_release, client_app.GaussianHistogram = original_release, original_class  # type: ignore[misc]


def main() -> None:
    """Run the grid, write the CSV, print the table."""
    from common.tables import load_table

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--release", action="append", default=None)
    ap.add_argument("--out", default="docs/audit_power.csv")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="fedsyn-audit-power-"))
    load_table("bbc-news")[["text", "topic"]].sample(150, random_state=0).to_csv(folder / "site.csv", index=False)
    node = {"tier": "weak", "data-path": str(folder / "site.csv"), "max-records": 10000,
            "state-dir": str(folder / "state"), "epsilon": 8.0}
    rows = []
    for bug in ("sigma", "sensitivity"):
        for f in FACTORS:
            if bug == "sensitivity" and f == 1.0:
                continue
            for rep in range(args.reps):
                t0 = time.perf_counter()
                with planted(bug, f):
                    audit = run_audit(node, only=args.release or ["profile", "vote:knn-vote"],
                                      scratch=folder / "scratch", progress=False)
                for r in audit.results:
                    rows.append({"bug": bug, "factor": f, "rep": rep, "release": r.kind, "stated": r.stated_epsilon,
                                 "lower": round(r.lower, 4), "lower_gaussian": round(r.lower_gaussian, 4),
                                 "lower_threshold": round(r.lower_threshold, 4), "draws": r.draws,
                                 "failed": r.failed, "seconds": round(time.perf_counter() - t0, 1)})
                print(rows[-1], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\n{'bug':12} {'factor':>6} {'release':16} {'caught':>7} {'lower bounds (stated)':>30}")
    for key in dict.fromkeys((r["bug"], r["factor"], r["release"]) for r in rows):
        same = [r for r in rows if (r["bug"], r["factor"], r["release"]) == key]
        lows = ", ".join(f"{r['lower']:.2f}" for r in same)
        print(f"{key[0]:12} {key[1]:6.2f} {key[2]:16} {sum(r['failed'] for r in same):3d}/{len(same):<3d} "
              f"{lows} ({same[0]['stated']:.3g})")


if __name__ == "__main__":
    main()
