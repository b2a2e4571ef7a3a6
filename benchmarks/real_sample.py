"""N real training records of a run's dataset, drawn at random, as a JSONL that ``fedsyn evaluate`` reads
as a synthetic set: the "N real texts beside it" reference of issue 74 (what the same classifier scores
when trained on real records instead of synthetic ones).

    python -m benchmarks.real_sample <run-dir> --n 600 --seed 0 --out real600.jsonl
    fedsyn evaluate --synthetic real600.jsonl --real <run-dir>/heldout.jsonl --no-mauve --seed 0

The records are the benchmark's training split (the sites' data in a simulation), read from the run's
``config.json`` as the run read them; nothing here leaves a site in a deployment, since it runs on the
public benchmark only.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from common.config import RunConfig
from common.federation import benchmark
from common.io import atomic_write_text


def sample_real(run_dir: Path, n: int, seed: int) -> list[dict[str, str]]:
    """``n`` records of the run's training split, drawn without replacement with ``seed``: text and
    control code, the shape of a run's ``synthetic.jsonl``."""
    cfg = json.loads((run_dir / "config.json").read_text())
    bench = benchmark(RunConfig.from_flower(cfg.get("run_config", cfg)))
    train = bench.train
    if n > len(train.texts):
        raise SystemExit(f"--n {n} is more than the {len(train.texts)} training records: ask for fewer")
    picked = random.Random(seed).sample(range(len(train.texts)), n)
    return [{"text": train.texts[i], "control_code": train.codes[i]} for i in picked]


def main() -> None:
    """Write the sample to ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = sample_real(args.run_dir, args.n, args.seed)
    atomic_write_text(args.out, "".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} real records -> {args.out}")


if __name__ == "__main__":
    main()
