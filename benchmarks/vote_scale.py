"""A vote's reply time at institution scale (issue 61): max-records = 1,000 / 10,000 / 100,000.

Usage: python -m benchmarks.vote_scale [--bounds 1000 10000 100000] [--replies 3] [--pool 240]
       [--build-up-to 10000] [--before-up-to 1000] [--out benchmarks/vote_scale.json]

For each bound M, a deployed weak node holds a file of M records (BBC News articles, cycled, each
made distinct by its number) with max-records = M, and answers a contrastive vote over ``--pool``
candidates through the real ClientApp, each reply in a fresh forked process as a SuperNode runs it
(``benchmarks.reply_time``: the embedder is loaded before the clock, the rest is in it). Measured:

- the snapshot: the first read of the file into the node's view (what node-check does once);
- the build: embedding the view's M rows into the node's matrix (node-check, once per snapshot).
  Its work is M rows of the window by construction, so above ``--build-up-to`` it is not run: the
  matrix is filled with random unit rows under the snapshot's real stamp (a vote's time does not
  depend on the values) and the build time is the measured per-row rate times M;
- ``after``: a vote reading the matrix (this code);
- ``before``: the same vote with the matrix taken away (``Node.embedded`` returns None: the records
  embedded in the vote, as before issue 61), run up to ``--before-up-to`` and for larger bounds
  extrapolated from the measured per-row rate.

Writes ``--out`` (JSON) and prints the table for ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from common.config import RunConfig
from common.data import load_table
from common.io import atomic_write_json


def write_node(folder: Path, records: int, pool: int) -> tuple[str, list[str], list[str], list[str]]:
    """A CSV of ``records`` BBC articles (cycled, numbered), the vocabulary, and ``pool`` candidates."""
    import pandas as pd

    cfg = RunConfig()
    frame = load_table(cfg.dataset)
    column = cfg.control_columns[0]
    n = len(frame)
    index = np.arange(records) % (n - pool)
    texts = [f"{frame[cfg.text_column].iloc[i]} ({k})" for k, i in enumerate(index)]
    path = folder / f"node-{records}.csv"
    pd.DataFrame({cfg.text_column: texts, column: frame[column].to_numpy()[index]}).to_csv(path, index=False)
    vocabulary = sorted(f"{column}={v}" for v in frame[column].unique())
    tail = frame.iloc[n - pool:]
    return str(path), vocabulary, list(tail[cfg.text_column]), [f"{column}={v}" for v in tail[column]]


def _prepare(data: str, state: Path, bound: int, build: bool) -> dict[str, float]:
    """The node's snapshot, then its matrix (built, or filled at random under its stamp): seconds of each."""
    from benchmarks.reply_time import node_config
    from fedsyn_client import node as node_module, record_matrix
    from fedsyn_client.policy import policy_from_node_config

    cfg = RunConfig()
    policy = policy_from_node_config(node_config("vote", data, state, bound))
    t0 = time.perf_counter()
    node = node_module.open_node(policy, cfg)
    snapshot = time.perf_counter() - t0
    if build:
        t0 = time.perf_counter()
        node.matrix(False, cfg.embedder, cfg.vote_window, cfg.precision)
        return {"snapshot_s": snapshot, "build_s": time.perf_counter() - t0, "kept": len(node.data)}
    real = record_matrix.embed_slots

    def random_rows(texts, embedder, window, rows, progress=None):
        vectors = np.random.default_rng(0).standard_normal((rows, 384)).astype(np.float32)
        vectors[len(texts):] = 0.0
        return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)

    node_module.embed_slots = random_rows
    try:
        node.matrix(False, cfg.embedder, cfg.vote_window, cfg.precision)
    finally:
        node_module.embed_slots = real
    return {"snapshot_s": snapshot, "build_s": float("nan"), "kept": len(node.data)}


def _vote(data: str, state: Path, bound: int, variant: str, vocabulary, texts, codes) -> float:
    """Seconds the real ClientApp took to answer one contrastive vote (``variant``: after / before)."""
    from benchmarks.reply_time import message, node_config, run_config
    from common.models import load_embedder
    from fedsyn_client import node as node_module
    from fedsyn_client.client_app import app
    from tests.fakes import client_node, set_task_identity

    if variant == "before":  # the records embedded in the vote, as before issue 61
        node_module.Node.embedded = lambda self, *a, **k: None
    set_task_identity()
    rc = run_config(data, RunConfig().model)
    load_embedder(RunConfig.from_flower(rc).embedder)
    node = client_node(app, 5, node_config("vote", data, state, bound), rc, run_id=1)
    msg = message("vote", vocabulary, texts, codes, None, RunConfig.from_flower(rc))
    t0 = time.perf_counter()
    reply = node(msg)
    took = time.perf_counter() - t0
    if reply.has_error():
        raise RuntimeError(f"vote at {bound}: {reply.error.reason}")
    return took


def measure(bounds: list[int], replies: int, pool: int, build_up_to: int, before_up_to: int,
            folder: Path) -> list[dict[str, Any]]:
    """One row per bound: snapshot, build, and the vote's seconds after and before."""
    import shutil

    import sentence_transformers  # noqa: F401 - imported once, before the forks (as reply_time does)

    from benchmarks.reply_time import _forked
    from fedsyn_client import client_app  # noqa: F401
    rows = []
    rate = None  # seconds per row of a build, measured at the largest built bound
    before_rate = None
    for bound in bounds:
        data, vocabulary, texts, codes = write_node(folder, bound, pool)
        seed = folder / f"seed-{bound}"
        row: dict[str, Any] = {"bound": bound, "pool": pool,
                               **_forked(_prepare, data, seed, bound, bound <= build_up_to)}
        if bound <= build_up_to:
            rate = row["build_s"] / bound
        elif rate is not None:
            row["build_s_extrapolated"] = rate * bound
        for variant in ("after", "before"):
            if variant == "before" and bound > before_up_to:
                if before_rate is not None:
                    row["before_s_extrapolated"] = before_rate * bound
                continue
            times = []
            for i in range(replies):
                state = folder / f"s-{bound}-{variant}-{i}"
                shutil.copytree(seed, state, ignore=shutil.ignore_patterns("ledger*", "*.lock"))
                times.append(_forked(_vote, data, state, bound, variant, vocabulary, texts, codes))
                shutil.rmtree(state, ignore_errors=True)
                print(f"M={bound} {variant} vote {i + 1}/{replies}: {times[-1]:.2f} s", file=sys.stderr, flush=True)
            row[f"{variant}_s"] = times
            if variant == "before":
                before_rate = float(np.median(times)) / bound
        shutil.rmtree(seed, ignore_errors=True)
        Path(data).unlink()
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Measure, write ``--out``, print the README table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bounds", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--replies", type=int, default=3)
    ap.add_argument("--pool", type=int, default=240)
    ap.add_argument("--build-up-to", type=int, default=10000)
    ap.add_argument("--before-up-to", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/vote_scale.json"))
    args = ap.parse_args(argv)
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(args.bounds, args.replies, args.pool, args.build_up_to, args.before_up_to, Path(tmp))
    result = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": round(time.time() - started),
              "embedder": RunConfig().embedder, "window": RunConfig().vote_window, "rows": rows}
    atomic_write_json(args.out, result)
    print("| max-records | view kept | snapshot (once) | matrix build (once) | vote before | "
          "vote after (median, min-max) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        build = (f"{r['build_s']:.0f} s" if r["build_s"] == r["build_s"]
                 else f"≈{r.get('build_s_extrapolated', float('nan')):.0f} s (extrapolated)")
        before = (f"{np.median(r['before_s']):.1f} s" if "before_s" in r
                  else f"≈{r.get('before_s_extrapolated', float('nan')):.0f} s (extrapolated)")
        after = r["after_s"]
        print(f"| {r['bound']:,} | {r['kept']:,} | {r['snapshot_s']:.1f} s | {build} | {before} | "
              f"{np.median(after):.2f} s ({min(after):.2f}-{max(after):.2f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
