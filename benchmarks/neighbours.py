"""The neighbouring-datasets harness at a larger example budget than CI's (issue 31).

Usage: python -m benchmarks.neighbours [--examples 300] [--seed 0] [--out docs/neighbours.json]

Draws request sequences with the same strategies as ``tests/test_neighbours.py``, plays each
against two nodes whose data differ in one record (``tests/neighbours.py``) and stops at the first
difference (an outcome that depends on the records), which it prints with the sequence that showed
it. It also tallies what the examples exercised (per message type: releases and each error text),
so a run that passes can be read for coverage. The result goes to ``--out`` as JSON and a
summary line for docs/testing.md is printed. Needs the ``test`` extra (hypothesis).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from common.io import atomic_write_json
from tests.neighbours import first_difference, play, write_pair
from tests.test_neighbours import sequences


def run(examples: int, seed_: int) -> dict:
    """Play ``examples`` generated sequences; returns the tally and the first difference (or None)."""
    tally: collections.Counter = collections.Counter()
    found: list[str] = []

    @seed(seed_)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(steps=sequences, remove=st.sampled_from(["y", "z"]), table=st.booleans())
    def check(steps, remove, table):
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            d, d_minus = write_pair(folder, remove, table)
            seen = [play(steps, data, folder / f"state-{i}", table) for i, data in enumerate((d, d_minus))]
        for step, obs in zip(steps, seen[0]):
            tally[f"{step.message}: {obs.error[1] if obs.error else 'release'}"] += 1
        difference = first_difference(*seen, steps)
        if difference is not None:
            found.append(difference)
            raise AssertionError(difference)

    start = time.time()
    try:
        check()
    except AssertionError:
        pass
    return {"examples": examples, "seed": seed_, "seconds": round(time.time() - start, 1),
            "difference": found[-1] if found else None, "exercised": dict(sorted(tally.items()))}


def main(argv: list[str] | None = None) -> int:
    """Run the harness; exit 1 when a difference was found."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("docs/neighbours.json"))
    args = parser.parse_args(argv)
    result = run(args.examples, args.seed)
    atomic_write_json(args.out, result)
    releases = sum(v for k, v in result["exercised"].items() if k.endswith(": release"))
    print(f"{args.examples} examples (seed {args.seed}) in {result['seconds']:.0f} s: {sum(result['exercised'].values())} "
          f"requests, {releases} releases; " + ("no difference" if result["difference"] is None else
                                                "DIFFERENCE:\n" + result["difference"]))
    return 0 if result["difference"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
