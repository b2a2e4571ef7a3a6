"""Issue 73: the noise in the server's sum when every site adds the whole noise (t = 1) against
sites that share it under secure aggregation (t = K), per release kind, by the nodes' own maths.

For K sites at a per-release epsilon, each count histogram of sensitivity sqrt(c): at t = 1 each
site adds a Gaussian of sigma (analytic, Balle & Wang) and the sum carries sqrt(K) sigma; at t = K
each adds Skellam(mu / K) with mu solved by ``common.skellam`` (exact PLD) and the sum carries
Skellam(mu), standard deviation sqrt(2 mu). POPri's similarity scores (sensitivity 1, real values) are
scaled by ``skellam.SCALE`` and rounded within ``skellam.rounded_norm`` of 2,400 values, their mu solved by
the Renyi bound at the same delta (a node reads it at its release's part of its delta: a little more
noise), the sum's standard deviation sqrt(2 mu) / SCALE. Prints a table and writes
``benchmarks/shared_noise.json``.
Also times one masked round's cryptography for K sites (keys, shares, masks, unmasking; no model).

    python -m benchmarks.shared_noise [--sites 4 16 100] [--epsilons 1 8]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from common import skellam
from common.dp import analytic_gaussian_sigma
from common.secagg.protocol import Participant, Terms, route, unmask

KINDS: dict[str, int | None] = {"profile (c = 1)": 1, "kNN vote, K = 4 (c = 4)": 4,
                                "contrastive vote, K = 4 (c = 8)": 8, "similarity, 2,400 values (rounded)": None}


def noise_table(sites: list[int], epsilons: list[float], delta: float = 1e-5) -> list[dict]:
    """One row per (release kind, epsilon, K): the sum's noise standard deviation at t = 1 and t = K."""
    rows = []
    for kind, c in KINDS.items():
        shift: skellam.Shift = c if c is not None else skellam.Rounded(skellam.rounded_norm(skellam.SCALE, 2400), delta)
        scale = 1.0 if c is not None else float(skellam.SCALE)
        for eps in epsilons:
            sigma = analytic_gaussian_sigma(eps, delta, math.sqrt(c) if c is not None else 1.0)
            mu = skellam.solve_mu(eps, shift, delta)
            for k in sites:
                alone = skellam.epsilon(mu / k, shift, delta)
                t_k = math.sqrt(2 * mu) / scale
                rows.append({"release": kind, "epsilon": eps, "sites": k, "sum_stddev_t1": math.sqrt(k) * sigma,
                             "sum_stddev_tK": t_k, "ratio": math.sqrt(k) * sigma / t_k, "epsilon_alone_tK": alone})
    return rows


def round_seconds(k: int, length: int, dropped: int = 1) -> float:
    """Wall seconds of one masked round's cryptography for ``k`` sites of ``length`` values, with
    ``dropped`` sites lost after sharing (their masks rebuilt from shares)."""
    terms = Terms(b"benchmark", length, 40)
    t0 = time.perf_counter()
    sites = [Participant(i + 1, terms, k - dropped, 10.0) for i in range(k)]  # each trusts the survivors
    adverts = [p.advertise(k) for p in sites]
    sealed, commits = {}, {}
    for p in sites:
        sealed[p.site], commits[p.site] = p.share(adverts)
    inbox = route(sealed)
    live = sites[dropped:]
    masked = {p.site: p.mask(inbox[p.site], np.zeros(length, dtype=np.int64)) for p in live}
    signatures = {p.site: p.confirm(sorted(masked)) for p in live}
    revealed = {p.site: p.reveal(signatures) for p in live}
    unmask(terms, {a.site: a for a in adverts}, commits, masked, revealed)
    return time.perf_counter() - t0


def main() -> None:
    """Print the table and the round timings; write ``benchmarks/shared_noise.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[4, 16, 100])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 8.0])
    parser.add_argument("--length", type=int, default=2400, help="values per masked vector (a 2,400-text pool)")
    args = parser.parse_args()
    rows = noise_table(args.sites, args.epsilons)
    print(f"{'release':34} {'eps':>4} {'K':>4} {'sum sd, t=1':>12} {'sum sd, t=K':>12} {'ratio':>6} {'eps alone':>9}")
    for r in rows:
        print(f"{r['release']:34} {r['epsilon']:4g} {r['sites']:4d} {r['sum_stddev_t1']:12.3f} "
              f"{r['sum_stddev_tK']:12.3f} {r['ratio']:6.2f} {r['epsilon_alone_tK']:9.3f}")
    timings = {}
    for k in [k for k in args.sites if k <= 16]:
        timings[k] = round_seconds(k, args.length)
        print(f"one masked round, {k} sites x {args.length} values, one dropped after sharing: {timings[k]:.2f} s")
    out = Path(__file__).with_name("shared_noise.json")
    out.write_text(json.dumps({"rows": rows, "round_seconds": timings, "length": args.length,
                               "date": time.strftime("%Y-%m-%d")}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
