"""How a run's cost grows: time and peak memory against nodes, synthetic texts and records.

Usage: python -m benchmarks.scale [--runs nodes,texts] [--default-model NODES] [--marginals NODES] [--kernel]
                                  [--out docs]

- ``--runs``: real ``flwr run`` simulations of the tiny model (one phase-1 round of 2 steps, so
  the per-message machinery, not training, is what grows): nodes 10, 30, 100 at 120 texts, and
  texts 120, 1,000, 10,000 at 10 nodes. Each row: wall time, the run's own stage timings
  (``metrics.json``), peak memory summed over every process of the run (SuperLink, ServerApp,
  Ray and its ClientApp workers; PSS, so shared pages count once) and how many worker processes
  ran ClientApps (from the nodes' ``workers.jsonl``: Python, models and embedder are loaded once
  per worker, whatever the node count).
- ``--default-model 100``: one run of 100 nodes with the default model (SmolLM2-135M, LoRA) and
  1 round of 1 DP-SGD step (memory does not depend on the steps).
- ``--marginals 100``: one run of 100 sites making a table by federated marginals (issue 48:
  Breast Cancer, ``presets/table-marginals.toml``, 120 rows; about 5 rows per site).
- ``--kernel``: a weak node's kNN vote (``common.voting.knn_votes``) on random unit
  embeddings, records 10^3..10^5 x texts 120..10^4, one control code (the worst case: all pairs
  in one matrix), in blocks (the node's code) and as one matrix (before issue 24, where it fits
  in memory). Peak memory by ``tracemalloc`` (numpy's buffers are traced).

Writes ``<out>/scale.csv`` (one row per measurement) and ``<out>/scale.png``.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np

from common.io import read_jsonl

FIELDS = ["sweep", "nodes", "texts", "records", "variant", "seconds", "peak_mib", "workers", "tiers", "finetune",
          "profile", "generate", "refine", "marginals"]
TINY = {"model": "tiny-gpt2", "num-server-rounds": 1, "local-steps": 2, "batch-size": 4, "max-new-tokens": 8,
        "test-fraction": 0.02, "strong-fraction": 0.5}
NODES, TEXTS = (10, 30, 100), (120, 1000, 10000)
RECORDS = (1000, 10000, 100000)
DIM = 384  # all-MiniLM-L6-v2


def summed_pss_mib(pids: list[int]) -> float:
    """Proportional set size of ``pids`` together, in MiB (a process that is gone counts 0)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
                    break
        except OSError:
            continue
    return total / 1024


class PeakMemory:
    """Sample the summed PSS of every process naming ``flwr_home`` (and their descendants)."""

    def __init__(self, flwr_home: Path, every: float = 0.5) -> None:
        self.flwr_home, self.every, self.peak = str(flwr_home), every, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        from fedsyn_server.flwr_runner import processes, with_descendants

        while not self._stop.is_set():
            pids = with_descendants([pid for pid, cmd in processes().items() if self.flwr_home in cmd])
            self.peak = max(self.peak, summed_pss_mib(pids))
            self._stop.wait(self.every)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def marginals_settings() -> dict:
    """``presets/table-marginals.toml``: Breast Cancer by federated marginals (issue 48)."""
    import tomllib

    preset = tomllib.loads((Path(__file__).parents[1] / "presets" / "table-marginals.toml").read_text())
    # one line: a run-config override (key=value) cannot hold the preset's line breaks
    return {**preset, "table-schema": json.dumps(json.loads(preset["table-schema"]))}


def measure_run(nodes: int, texts: int, out: Path, default_model: bool = False, marginals: bool = False) -> dict:
    """One simulation of ``nodes`` nodes and ``texts`` synthetic texts: a CSV row. The tiny model,
    or (``default_model``) the default one with 1 round of 1 step: memory does not depend on the
    steps, and the defaults' 2 x 12 at 100 nodes would take hours on 2 cores; or (``marginals``)
    a Breast Cancer table by federated marginals, ``texts`` rows (no model at all)."""
    from common.config import RunConfig
    from common.federation import simulation_tiers
    from fedsyn_client.node import STATE_ENV
    from fedsyn_client.placement import PLACEMENT_FILE
    from fedsyn_server.flwr_runner import run_app

    home = Path(tempfile.mkdtemp(prefix="fedsyn-flwr-home-"))
    state = Path(tempfile.mkdtemp(prefix="fedsyn-scale-state-"))
    name = f"n{nodes}-t{texts}" + ("-default" if default_model else "-marginals" if marginals else "")
    settings = ({"num-server-rounds": 1, "local-steps": 1, "strong-fraction": 0.5} if default_model else
                {**marginals_settings(), "sampling-rate": 1.0, "strong-fraction": 0.5} if marginals else TINY)
    with PeakMemory(home) as mem:
        res = run_app({**settings, "num-synthetic": texts, "out-dir": str(out), "run-name": name, "min-nodes": nodes},
                      f"num-supernodes={nodes}", timeout=3600, env={STATE_ENV: str(state)}, flwr_home=home,
                      log_path=out / f"{name}.log")
    if not res.ok:
        raise RuntimeError(f"{name}: {res.status}\n{res.output[-3000:]}")
    timings = json.loads((res.run_dir / "metrics.json").read_text())["timings_s"]
    workers = {p["pid"] for f in state.glob(f"run-*/node-*/{PLACEMENT_FILE}") for p in read_jsonl(f)}
    weak = simulation_tiers(nodes, TINY["strong-fraction"]).count("weak")
    from common.federation import benchmark

    records = len(benchmark(RunConfig.from_flower({**(settings if marginals else TINY)})).train) // nodes  # per node
    row = {"sweep": "run-default" if default_model else "run-marginals" if marginals else "run", "nodes": nodes,
           "texts": texts, "records": records, "variant": f"{weak} weak",
           "seconds": round(res.seconds, 1), "peak_mib": round(mem.peak), "workers": len(workers)}
    row.update({k: round(float(timings.get(k, 0.0)), 1) for k in FIELDS[8:]})
    return row


def measure_kernel(records: int, texts: int, blocked: bool, seed: int = 0) -> dict:
    """The kNN vote of one node: ``records`` x ``texts`` of one code, in blocks or whole."""
    from common import voting

    rng = np.random.default_rng(seed)
    loc = rng.standard_normal((records, DIM))
    loc /= np.linalg.norm(loc, axis=1, keepdims=True)
    syn = rng.standard_normal((texts, DIM))
    syn /= np.linalg.norm(syn, axis=1, keepdims=True)
    before = voting.BLOCK_PAIRS
    voting.BLOCK_PAIRS = before if blocked else records * texts
    try:
        tracemalloc.start()
        t0 = time.perf_counter()
        votes = voting.knn_votes(loc, ["c"] * records, syn, ["c"] * texts, 4)
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        voting.BLOCK_PAIRS = before
    assert votes.sum() == 4 * records
    return {"sweep": "kernel", "nodes": 1, "texts": texts, "records": records,
            "variant": "blocks" if blocked else "whole", "seconds": round(seconds, 3), "peak_mib": round(peak / 2**20)}


def growth(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """(a, b, p): the line y = a + b x and the exponent p of y ~ x^p, both by least squares. A run
    has a fixed part (start-up, evaluation), so the line says more than the exponent."""
    b, a = np.polyfit(xs, ys, 1)
    return float(a), float(b), float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def plot(rows: list[dict], path: Path) -> None:
    """Three panels: run time and memory vs nodes, vs texts; the vote kernel vs records x texts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, fixed in ((axes[0], "nodes", "texts"), (axes[1], "texts", "nodes")):
        pts = sorted((r for r in rows if r["sweep"] == "run" and r[fixed] == (120 if fixed == "texts" else 10)),
                     key=lambda r: r[key])
        if not pts:
            continue
        xs = [r[key] for r in pts]
        ax.plot(xs, [r["seconds"] for r in pts], "o-", label="wall time (s)")
        for stage in ("finetune", "refine", "generate"):
            ax.plot(xs, [r[stage] for r in pts], ".--", label=f"{stage} (s)")
        ax.set_xscale("log"), ax.set_yscale("log"), ax.set_xlabel(key), ax.set_ylabel("seconds")
        mem = ax.twinx()
        mem.plot(xs, [r["peak_mib"] / 1024 for r in pts], "s:", color="black", label="peak memory (GiB)")
        mem.set_ylabel("peak memory, all processes (GiB)")
        mem.set_ylim(0, 1.3 * max(r["peak_mib"] for r in pts) / 1024)  # from 0: flat must look flat
        ax.legend(loc="upper left", fontsize=8), mem.legend(loc="lower right", fontsize=8)
        ax.set_title(f"flwr run, tiny model: time vs {key}")
    ax = axes[2]
    for variant, style in (("blocks", "o-"), ("whole", "x--")):
        for texts in TEXTS:
            pts = sorted((r for r in rows
                          if r["sweep"] == "kernel" and r["variant"] == variant and r["texts"] == texts),
                         key=lambda r: r["records"])
            if pts:
                ax.plot([r["records"] for r in pts], [r["peak_mib"] for r in pts], style,
                        label=f"{variant}, {texts} texts")
    ax.set_xscale("log"), ax.set_yscale("log"), ax.set_xlabel("records on the node"), ax.set_ylabel("peak MiB")
    ax.set_title("kNN vote, one code: peak memory"), ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


def write_csv(rows: list[dict], path: Path) -> None:
    """All rows, atomically."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, FIELDS)
        w.writeheader()
        w.writerows({k: r.get(k, "") for k in FIELDS} for r in rows)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    """Measure what is asked, merge with the rows already in ``<out>/scale.csv``, plot."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="", help="'nodes', 'texts' or 'nodes,texts': the flwr run sweeps")
    ap.add_argument("--kernel", action="store_true", help="the kNN vote sweep")
    ap.add_argument("--default-model", type=int, default=0, metavar="NODES",
                    help="one run of NODES nodes with the default model (1 round of 1 step)")
    ap.add_argument("--marginals", type=int, default=0, metavar="NODES",
                    help="one run of NODES sites making a table by federated marginals (Breast Cancer, 120 rows)")
    ap.add_argument("--out", default="docs", type=Path)
    ap.add_argument("--whole-limit-gib", type=float, default=6.0,
                    help="skip the one-matrix kNN where it would need more than this")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / "scale.csv"
    rows = []
    if csv_path.exists():
        with open(csv_path) as fh:
            rows = [{k: _num(v) for k, v in r.items()} for r in csv.DictReader(fh)]

    def keep(row: dict) -> None:  # a new measurement replaces the old one of the same cell
        nonlocal rows
        cell = ("sweep", "nodes", "texts", "records", "variant")
        rows = [r for r in rows if any(r[k] != row[k] for k in cell)] + [row]
        print(json.dumps(row), flush=True)
        write_csv(rows, csv_path)

    if args.kernel:
        for records in RECORDS:
            for texts in TEXTS:
                keep(measure_kernel(records, texts, blocked=True))
                if records * texts * 8 * 3 / 2**30 <= args.whole_limit_gib:  # sims, -sims and argpartition
                    keep(measure_kernel(records, texts, blocked=False))
    sweeps = set(filter(None, args.runs.split(",")))
    with tempfile.TemporaryDirectory(prefix="fedsyn-scale-") as tmp:
        runs = Path(tmp)
        if "nodes" in sweeps:
            for nodes in NODES:
                keep(measure_run(nodes, 120, runs))
        if "texts" in sweeps:
            for texts in TEXTS[1:] if "nodes" in sweeps else TEXTS:
                keep(measure_run(10, texts, runs))
        if args.default_model:
            keep(measure_run(args.default_model, 120, runs, default_model=True))
        if args.marginals:
            keep(measure_run(args.marginals, 120, runs, marginals=True))
    plot(rows, args.out / "scale.png")
    for key, fixed, value in (("nodes", "texts", 120), ("texts", "nodes", 10)):
        pts = sorted((r for r in rows if r["sweep"] == "run" and r[fixed] == value), key=lambda r: r[key])
        if len(pts) >= 2:
            xs = [r[key] for r in pts]
            for what in ("seconds", "finetune", "refine", "peak_mib"):
                a, b, p = growth(xs, [max(r[what], 1e-3) for r in pts])
                print(f"{what} vs {key}: {a:.1f} + {b:.4g} x {key} (exponent {p:.2f})")
    return 0


def _num(v: str) -> object:
    try:
        f = float(v)
        return int(f) if f.is_integer() and "." not in v else f
    except ValueError:
        return v


if __name__ == "__main__":
    sys.exit(main())
