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
Also times one masked round's cryptography for K sites (keys, shares, masks, unmasking; no model) and
counts the bytes of its five steps per site.

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
from common.secagg.protocol import Participant, Terms, advert_to_dict, b64, revealed_to_dict, route, unmask

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


def round_cost(k: int, length: int, dropped: int = 1) -> dict[str, float]:
    """One masked round's cryptography for ``k`` sites of ``length`` values, with ``dropped`` sites
    lost after sharing (their masks rebuilt from shares): wall seconds, and the bytes of the five
    steps' payloads as the node and the server encode them (JSON, base64), per site: what the server
    sends it (down) and what it sends back (up). Flower's own message framing is not counted."""
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
    seconds = time.perf_counter() - t0

    def size(value: object) -> int:
        return len(json.dumps(value))

    site = live[0].site  # a survivor: it takes part in every step
    down = (size({"sites": k}) + size({"adverts": [advert_to_dict(a) for a in adverts], "bits": 40})
            + size({"bundles": {str(j): b64(v) for j, v in inbox[site].items()}})
            + size({"survivors": sorted(masked)})
            + size({"signatures": {str(j): b64(v) for j, v in signatures.items()}}))
    up = (size({"advert": advert_to_dict(adverts[site - 1]), "context": b64(terms.context)})
          + size({"sealed": {str(j): b64(v) for j, v in sealed[site].items()}, "commitment": b64(commits[site])})
          + size({"masked": b64(np.asarray(masked[site], dtype="<u8").tobytes())})
          + size({"signature": b64(signatures[site])}) + size(revealed_to_dict(revealed[site])))
    return {"seconds": seconds, "bytes_down_per_site": down, "bytes_up_per_site": up,
            "bytes_plain_per_site": size({"values": [0.0] * length})}


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
    for k in args.sites:
        timings[k] = round_cost(k, args.length)
        c = timings[k]
        print(f"one masked round, {k} sites x {args.length} values, one dropped after sharing: {c['seconds']:.2f} s; "
              f"per site {c['bytes_down_per_site'] / 1e3:.1f} kB down, {c['bytes_up_per_site'] / 1e3:.1f} kB up")
    out = Path(__file__).with_name("shared_noise.json")
    out.write_text(json.dumps({"rows": rows, "rounds": timings, "length": args.length,
                               "date": time.strftime("%Y-%m-%d")}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
