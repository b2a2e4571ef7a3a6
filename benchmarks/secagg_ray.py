"""Issue 73: what one masked round costs in a real ``flwr run`` on Flower's Ray simulation engine.

    python -m benchmarks.secagg_ray [--sites 4 16 100] [--out benchmarks/secagg_ray.json]

For each K, two tiny runs (tiny-gpt2, no phase 1, 20 candidates, all-MiniLM votes) of K simulated
sites through ``flwr run`` (a local SuperLink, Ray's actors running the ClientApps): at t = 1 (each
site adds the whole noise, one request per release) and at t = K (the profile and the vote are
masked rounds of five requests). The profile stage is one aggregated round and nothing else (the
sites' counts are free to compute), so its seconds in the run's ``metrics.json`` are the round's
time: the masked round against the plain one. The refine stage holds one vote round (with its
embedding). Bytes per site are the payloads' (``benchmarks.shared_noise.round_cost``: the five
steps' JSON at K sites; a plain vote reply is its float vector). Writes ``--out`` and prints the
table for benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from common.io import atomic_write_json

TINY = {"model": "tiny-gpt2", "num-server-rounds": 0, "num-synthetic": 20, "max-new-tokens": 8,
        "test-fraction": 0.02, "voters": "all"}


def one_run(sites: int, honest: int, out: Path) -> dict[str, Any]:
    """A tiny ``flwr run`` of ``sites`` simulated sites at min-honest-nodes ``honest``: its stage
    timings, wall seconds and whether its rounds were masked."""
    from fedsyn_server.flwr_runner import run_app

    name = f"K{sites}-t{honest}"
    res = run_app({**TINY, "min-honest-nodes": honest, "out-dir": str(out), "run-name": name},
                  federation_config=f"num-supernodes={sites}", timeout=3600)
    if not res.ok or res.run_dir is None:
        raise RuntimeError(f"{name}: flwr run failed ({res.status})\n{res.output[-3000:]}")
    metrics = json.loads((res.run_dir / "metrics.json").read_text())
    return {"sites": sites, "honest": honest, "wall_s": round(res.seconds, 1),
            "timings_s": {k: round(float(v), 2) for k, v in metrics["timings_s"].items()},
            "masked": "masked sum of" in res.output}


def main(argv: list[str] | None = None) -> int:
    """Run the tiny runs, write ``--out``, print the table."""
    from benchmarks.shared_noise import round_cost

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sites", type=int, nargs="+", default=[4, 16, 100])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/secagg_ray.json"))
    args = ap.parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="fedsyn-secagg-ray-"))
    rows = []
    for k in args.sites:
        for honest in (1, k):
            rows.append(one_run(k, honest, out))
            print(rows[-1], flush=True)
    atomic_write_json(args.out, {"rows": rows})
    print("| sites | profile round t = 1 (s) | masked profile round t = K (s) | vote stage t = 1 / t = K (s) "
          "| run wall t = 1 / t = K (s) | bytes per site, masked round (down / up) |")
    print("|---|---|---|---|---|---|")
    for k in args.sites:
        one, every = (next(r for r in rows if r["sites"] == k and r["honest"] == h) for h in (1, k))
        cost = round_cost(k, 20, dropped=0)  # the vote's 20 candidates, no site lost
        print(f"| {k} | {one['timings_s']['profile']:.2f} | {every['timings_s']['profile']:.2f} | "
              f"{one['timings_s']['refine']:.1f} / {every['timings_s']['refine']:.1f} | "
              f"{one['wall_s']:.0f} / {every['wall_s']:.0f} | "
              f"{cost['bytes_down_per_site'] / 1e3:.1f} / {cost['bytes_up_per_site'] / 1e3:.1f} kB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
