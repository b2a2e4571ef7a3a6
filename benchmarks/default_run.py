"""Time the default run (`flwr run .` with pyproject defaults) and summarise its outputs.

Usage: python -m benchmarks.default_run [--num-supernodes N] [--out-dir DIR]
Prints wall time, phase timings, sizes, epsilon spent per node, and three synthetic texts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

from common.io import read_jsonl
from fedsyn_server.flwr_runner import run_app


def main() -> int:
    """Run once, print a summary; exit code of `flwr run`."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-supernodes", type=int, default=None)
    ap.add_argument("--out-dir", default=tempfile.mkdtemp(prefix="fedsyn-bench-"))
    ap.add_argument("--run-config", nargs="*", default=[], help="extra key=value overrides")
    args = ap.parse_args()
    overrides: dict[str, object] = {"out-dir": args.out_dir, "run-name": "default"}
    for kv in args.run_config:
        k, _, v = kv.partition("=")
        overrides[k] = json.loads(v) if v[:1].isdigit() or v in ("true", "false") else v
    fed = f"num-supernodes={args.num_supernodes}" if args.num_supernodes else None
    res = run_app(overrides, federation_config=fed, timeout=3600)
    print(f"flwr run exit {res.returncode}, status {res.status}, wall time {res.seconds:.0f}s")
    if not res.ok or res.run_dir is None:
        print(res.output[-5000:])
        return res.returncode or 1
    metrics = json.loads((res.run_dir / "metrics.json").read_text())
    report = json.loads((res.run_dir / "privacy_report.json").read_text())
    print("phase timings (s):", {k: round(v, 1) for k, v in metrics["timings_s"].items()})
    print("held-out loss by round:", metrics["eval"])
    print("pool", metrics["pool_size"], "final", metrics["final_size"], "failures", metrics["failures"])
    for n in report["nodes"]:
        print(f"node {n['node_id']} {n['tier']}: eps spent {n['epsilon_spent']:.3f} (PLD {n['epsilon_pld']:.3f})"
              f" of {n['epsilon_budget']}")
    rows = read_jsonl(res.run_dir / "synthetic.jsonl")
    for r in rows[:: max(1, len(rows) // 3)][:3]:
        print(f"[{r['control_code']}] {r['text'][:300]}")
    print("outputs:", res.run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
