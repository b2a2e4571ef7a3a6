"""Issue 73: downstream accuracy at t = 1 against t = K as sites join, the data fixed.

    python -m benchmarks.shared_noise_quality --pool RUN_DIR/pool.jsonl [--sites 2 4 8 16]
        [--epsilons 1 8] [--repeats 3] [--out benchmarks/shared_noise_quality.json]

What is fixed: the dataset's split and its IID partition into K sites (the run's seed), and the pool
of candidate texts (a real run's ``pool.jsonl``, both writers' texts: generation is not re-run, so
the only thing that changes between cells is the noise in the server's sums). What runs for real:
the strategy (``build_strategy``: tier query, profile, the default refinement's vote round,
A.4's resampling) over K simulated sites, each the real ClientApp on its partition with a fresh
state folder (its ledger) per cell; at t = K every profile and vote round is masked (the server's
``SecureSum``, the sites' ``secagg_node``), at t = 1 each site adds the whole noise. All sites are
weak (``strong-fraction = 0``, ``num-server-rounds = 0``): each spends its whole vote share on the
vote, as a default run's weak sites do; the pool's own code counts replace the allocation (the
pool is fixed). The final set (sampling-rate of each code's pool) is scored as a run's is: a
logistic regression on its embeddings, tested on the held-out real split (``downstream_utility``).

Each cell is repeated ``--repeats`` times (the sites' noise is drawn from the OS, so repeats differ
in the noise alone). Writes ``--out`` (JSON: every repeat) and prints the table for docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from common.config import RunConfig
from common.io import atomic_write_json, read_jsonl


def fixed_pool(path: Path) -> Any:
    """The pool of a run's ``pool.jsonl``, as the strategy's generation returns it."""
    from strategies.writers import Pool

    rows = read_jsonl(path)
    return Pool([r["text"] for r in rows], [r["control_code"] for r in rows], [r.get("writer", "pool") for r in rows],
                {"fixed": str(path)})


def run_cell(pool: Any, sites: int, epsilon: float, honest: int, key: str, states: Path,
             extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run of the real strategy over ``sites`` simulated sites at ``min-honest-nodes`` =
    ``honest`` with the pool fixed: the final set's indices into the pool, the vote rounds and the
    seconds."""
    from unittest import mock

    from fedsyn_client.client_app import app
    from fedsyn_server.server_app import build_strategy
    from tests.fakes import FakeGrid, client_node, set_task_identity

    # the default split of epsilon (profile 2 of 8) at every epsilon; at epsilon inf the votes carry no
    # noise (the reference) and the profile keeps its 2
    rc = {**RunConfig(num_server_rounds=0, strong_fraction=0.0).to_flower(), **(extra or {}),
          "epsilon": epsilon, "epsilon-profile": epsilon / 4 if math.isfinite(epsilon) else 2.0,
          "min-honest-nodes": honest}
    cfg = RunConfig.from_flower(rc)
    nodes = {100 + p: client_node(app, 100 + p, {"partition-id": p, "num-partitions": sites,
                                                 # a simulated site's ledger is its state folder's: one per cell
                                                 "state-dir": str(states / key / f"node{p}")},
                               rc, run_id=abs(hash(key)) % 2 ** 31)
             for p in range(sites)}
    set_task_identity()
    start = time.perf_counter()
    # the pool is fixed: generation returns it whatever the (noisy) profile allocated
    with mock.patch("strategies.text_stages.generate_pool", lambda *a, **k: pool):
        strategy, _, model = build_strategy(cfg)
        strategy.session.stable_seconds = 0.0
        res = strategy.start(FakeGrid(nodes), model.initial_arrays() if model is not None else None)
    if res.selected is None:
        raise RuntimeError(f"K={sites} eps={epsilon} t={honest}: no final set ({res.failures[:2]})")
    return {"selected": [int(i) for i in res.selected], "vote_rounds": res.vote_rounds,
            "failures": len(res.failures), "seconds": time.perf_counter() - start}


def score(pool: Any, selected: list[int], pool_emb: np.ndarray, test_emb: np.ndarray, test_codes: list[str],
          seed: int = 0) -> dict[str, Any]:
    """The final set's downstream accuracy and macro-F1 on the held-out real split."""
    from fedsyn_server.evaluation.utility import downstream_utility

    return downstream_utility(pool_emb[selected], [pool.codes[i] for i in selected], test_emb, test_codes, seed)


def measure(pool_path: Path, sites: list[int], epsilons: list[float], repeats: int, states: Path,
            extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every (K, epsilon, t in {1, K}, repeat) cell: its accuracy, macro-F1 and seconds."""
    from common.federation import benchmark
    from common.models import load_embedder
    from fedsyn_server.evaluation.sets import cached_embeddings

    pool = fixed_pool(pool_path)
    cfg = RunConfig.from_flower({**RunConfig().to_flower(), **(extra or {})})
    bench = benchmark(cfg)
    embedder = load_embedder(cfg.eval_embedder)
    pool_emb = np.asarray(cached_embeddings(embedder, "pool", pool.texts))
    test_emb = np.asarray(cached_embeddings(embedder, "heldout", bench.test.texts))
    rows = []
    for k in sites:
        for eps in [*epsilons, math.inf]:  # inf: the votes without noise, once (they are then exact)
            for honest in ((1, k) if math.isfinite(eps) else (1,)):
                for r in range(repeats if math.isfinite(eps) else 1):
                    key = f"q-K{k}-e{eps:g}-t{honest}-r{r}-{time.time_ns()}"
                    cell = run_cell(pool, k, eps, honest, key, states, extra)
                    s = score(pool, cell["selected"], pool_emb, test_emb, list(bench.test.codes))
                    rows.append({"sites": k, "epsilon": eps, "honest": honest, "repeat": r,
                                 "accuracy": s["accuracy"], "macro_f1": s["macro_f1"],
                                 "final": len(cell["selected"]), "failures": cell["failures"],
                                 "masked": all(v.get("masked", False) for v in cell["vote_rounds"]),
                                 "seconds": round(cell["seconds"], 1)})
                    print(f"K={k} eps={eps:g} t={honest} repeat {r}: accuracy {s['accuracy']:.3f} "
                          f"({cell['seconds']:.0f} s)", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table: mean accuracy ± its standard deviation over the repeats per cell, t = 1
    against t = K, and the votes without noise."""
    lines = ["| sites | ε | t = 1: accuracy | t = K: accuracy | t = K − t = 1 | votes without noise |",
             "|---|---|---|---|---|---|"]
    cells: dict[tuple[int, float], dict[str, list[float]]] = {}
    exact = {r["sites"]: r["accuracy"] for r in rows if not math.isfinite(float(r["epsilon"]))}
    for r in rows:
        side = "one" if r["honest"] == 1 else "all"
        cells.setdefault((r["sites"], float(r["epsilon"])), {"one": [], "all": []})[side].append(r["accuracy"])

    def spread(values: list[float]) -> str:
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{statistics.mean(values):.3f} ± {sd:.3f}"

    for (k, eps), got in sorted(cells.items()):
        one, every = got["one"], got["all"]
        if not one or not every:
            continue
        reference = f"{exact[k]:.3f}" if k in exact else "n/a"
        lines.append(f"| {k} | {eps:g} | {spread(one)} | {spread(every)} | "
                     f"{statistics.mean(every) - statistics.mean(one):+.3f} | {reference} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the grid, write ``--out``, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pool", type=Path, required=True, help="a run's pool.jsonl (its candidates)")
    ap.add_argument("--sites", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 8.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--states", type=Path, default=None,
                    help="where each cell's sites keep their state folders (default: a temporary folder)")
    ap.add_argument("--run-config", default="{}",
                    help="JSON of run-config keys for every cell (dataset, partitioning, ...)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/shared_noise_quality.json"))
    args = ap.parse_args(argv)
    states = args.states or Path(tempfile.mkdtemp(prefix="fedsyn-quality-"))
    extra = json.loads(args.run_config)
    rows = measure(args.pool, args.sites, args.epsilons, args.repeats, states, extra)
    atomic_write_json(args.out, {"pool": str(args.pool), "run_config": extra, "rows": rows})
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
