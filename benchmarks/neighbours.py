"""The neighbouring-datasets harness over every path a node serves, at a larger budget than CI's
(issues 31, 60).

Usage: python -m benchmarks.neighbours [--examples 1000] [--seed S] [--time-limit 3600]
       [--vote-every 4] [--train-every 16] [--sequence-every 16] [--out docs/neighbours.json]

An example is one cell of the grid paths x formats x sizes x positions x neighbours x bounds:
a text file, a table by rows, by marginals and with a free-text column; CSV, JSON Lines, gzipped
JSON Lines, Parquet; a file below, at and above ``max-records`` (20 or the harness's 100); one
record removed, or added (``tests.neighbours.ADD_KINDS``: an ordinary one, U+2028 / U+2029 / U+0085,
a lone surrogate escape, an integer beyond 64 bits, an empty, numeric or zero-padded category,
unicode, a long text), at the first, a middle or the last position. The cells are taken in an order
drawn from ``--seed`` (fresh by default, printed), each with its own drawn node secret. Every
example checks:

- the node's views of D and D' (``view_difference``: the whole file and ``view.bounded``'s view);
- the sensitivity check on the path's counting release (the profile, or a table's marginals);
- every ``--vote-every``-th example also one vote histogram (the four in turn), every
  ``--train-every``-th DP-SGD's clipped sum (``tests.neighbours.sensitivity_check``);
- every ``--sequence-every``-th a request sequence drawn by ``tests/test_neighbours.py``'s strategy,
  played on both nodes: every reply's structure and statement the same.

It stops after ``--examples`` cells or ``--time-limit`` seconds, whichever is first, and writes the
counts per path, format, size, position, neighbour and release, the largest distance against its
sensitivity per release, and every failure with the example that reproduces it, to ``--out``; a
summary for docs/testing.md is printed. Needs the ``test`` extra (hypothesis).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import logging
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from common.io import atomic_write_json
from tests.neighbours import (
    ADD_KINDS,
    FORMATS,
    MAX_RECORDS,
    PATHS,
    POSITIONS,
    VOTE_KINDS,
    Neighbour,
    Shape,
    applies,
    every_release,
    first_difference,
    play_pair,
    sensitivity_check,
    sizes,
    view_difference,
    write_neighbours,
)

BOUNDS = (20, MAX_RECORDS)


def grid(bounds: tuple[int, ...] = BOUNDS) -> list[tuple[Shape, Neighbour]]:
    """Every cell: (shape, neighbour) over paths, formats, sizes at each bound, positions and
    neighbours (one removal, every added kind that the format can hold)."""
    kinds = [("remove", "plain")] + [("add", k) for k in ADD_KINDS]
    cells = []
    for bound, path, fmt, position, (op, kind) in itertools.product(bounds, PATHS, FORMATS, POSITIONS, kinds):
        for size in sizes(bound):
            shape, neighbour = Shape(path, fmt, size, bound), Neighbour(op, position, kind)
            if applies(shape, neighbour):
                cells.append((shape, neighbour))
    return cells


def side(shape: Shape) -> str:
    """below, at or above the shape's max-records."""
    return "below" if shape.size < shape.max_records else "at" if shape.size == shape.max_records else "above"


def run(examples: int, seed_: int, time_limit: float, vote_every: int, train_every: int, sequence_every: int,
        bounds: tuple[int, ...] = BOUNDS) -> dict[str, Any]:
    """Check ``examples`` cells of the grid in the order ``seed_`` draws; the counts and failures."""
    rng = random.Random(seed_)
    cells = grid(bounds)
    rng.shuffle(cells)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    worst: dict[str, float] = {}
    failures: list[dict[str, Any]] = []
    start, done = time.time(), 0
    for i, (shape, neighbour) in enumerate(itertools.islice(itertools.cycle(cells), examples)):
        if time.time() - start > time_limit:
            break
        secret = rng.getrandbits(64)
        steps = every_release(shape, num_votes=1 + i % 3, histograms=(VOTE_KINDS[(i // vote_every) % 4],),
                              train=i % train_every == 1)
        if i % vote_every:  # the counting release (and DP-SGD) alone
            steps = [s for s in steps if s.message != "query.vote"]
        sequence = _drawn_sequence() if i % sequence_every == 3 else None
        found = check(shape, neighbour, secret, steps, sequence)
        done += 1
        kind = f"add {neighbour.record}" if neighbour.op == "add" else "remove"
        for key, value in (("path", shape.path), ("format", shape.format), ("position", neighbour.position),
                           ("size", f"{side(shape)} {shape.max_records}"), ("neighbour", kind)):
            counts[key][value] += 1
            counts[f"{key} failures"][value] += bool(found["failure"])
        for release, ratio in found["ratios"]:
            counts["release"][release] += 1
            worst[release] = max(worst.get(release, 0.0), ratio)
        counts["checks"].update(found["checks"])
        if found["failure"]:
            example = f"{shape!r}, {neighbour!r}, secret={secret}"
            failures.append({"example": example, "failure": found["failure"][:4000]})
            print(f"FAILURE {shape.describe()}, {neighbour.describe()}, secret {secret}:\n{found['failure'][:2000]}",
                  flush=True)
        if done % 25 == 0:
            print(f"{done} examples, {len(failures)} failures, {time.time() - start:.0f} s", flush=True)
    return {"examples": done, "seed": seed_, "seconds": round(time.time() - start, 1), "failures": failures,
            "counts": {k: dict(sorted(v.items())) for k, v in sorted(counts.items())},
            "largest distance / sensitivity": {k: round(v, 4) for k, v in sorted(worst.items())}}


def check(shape: Shape, neighbour: Neighbour, secret: int, steps: list, sequence: list | None) -> dict[str, Any]:
    """One example's checks; {"failure": "" or what failed, "ratios": [(release, distance /
    sensitivity)], "checks": Counter of what ran}."""
    out: dict[str, Any] = {"failure": "", "ratios": [], "checks": collections.Counter()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        try:
            d, other = write_neighbours(folder, shape, neighbour)
            views = view_difference(d, other, folder / "view", shape, secret=secret)
            out["checks"]["views"] += 1
            if views is not None:
                out["failure"] = f"views: {views}"
                return out
            for x in sensitivity_check(steps, d, other, folder / "sensitivity", shape, secret=secret):
                out["ratios"].append((x.release, x.distance / x.sensitivity if x.sensitivity else float("inf")))
                out["checks"]["sensitivity"] += 1
                if not x.within:
                    out["failure"] = f"sensitivity: {x}"
                    return out
            if sequence is not None:
                seen = play_pair(sequence, d, other, folder / "sequence", shape, secret=secret)
                out["checks"]["sequences"] += 1
                out["checks"]["requests"] += len(sequence)
                out["checks"]["releases"] += sum(o.kind == "release" for o in seen[0])
                difference = first_difference(*seen, sequence)
                if difference is not None:
                    out["failure"] = f"replies: {difference}\nsteps: {sequence!r}"
        except Exception as err:  # noqa: BLE001 - a harness error is reported with its example, and the run goes on
            out["failure"] = f"harness error: {type(err).__name__}: {err}"
    return out


def _drawn_sequence() -> list:
    """One request sequence drawn by ``tests/test_neighbours.py``'s strategy."""
    from hypothesis.errors import NonInteractiveExampleWarning

    from tests.test_neighbours import sequences

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonInteractiveExampleWarning)
        return sequences.example()


def summary(result: dict[str, Any]) -> str:
    """The lines for docs/testing.md."""
    counts = result["counts"]
    lines = [f"{result['examples']} examples (seed {result['seed']}) in {result['seconds']:.0f} s, "
             f"{len(result['failures'])} failures; checks: {counts.get('checks', {})}"]
    for key in ("path", "format", "size", "position", "neighbour", "release"):
        fails = counts.get(f"{key} failures", {})
        lines.append(f"{key}: " + ", ".join(f"{k} {v}" + (f" ({fails[k]} failed)" if fails.get(k) else "")
                                            for k, v in counts.get(key, {}).items()))
    lines.append("largest distance / stated sensitivity: " + ", ".join(
        f"{k} {v}" for k, v in result["largest distance / sensitivity"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the harness; exit 1 when a failure was found."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=None, help="the grid's order and the secrets (default: fresh)")
    parser.add_argument("--time-limit", type=float, default=3600.0, help="stop after this many seconds")
    parser.add_argument("--vote-every", type=int, default=4)
    parser.add_argument("--train-every", type=int, default=16)
    parser.add_argument("--sequence-every", type=int, default=16)
    parser.add_argument("--bounds", default=",".join(map(str, BOUNDS)), help="max-records values, comma-separated")
    parser.add_argument("--out", type=Path, default=Path("docs/neighbours.json"))
    args = parser.parse_args(argv)
    seed_ = args.seed if args.seed is not None else random.SystemRandom().getrandbits(32)
    print(f"seed {seed_}", flush=True)
    logging.disable(logging.ERROR)  # the nodes' own logs (refusals included): thousands of lines, not the result
    result = run(args.examples, seed_, args.time_limit, args.vote_every, args.train_every, args.sequence_every,
                 tuple(int(b) for b in args.bounds.split(",")))
    atomic_write_json(args.out, result)
    print(summary(result))
    return 0 if not result["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
