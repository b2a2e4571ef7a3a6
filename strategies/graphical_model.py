"""The server's half of federated marginals (issue 48): sum every site's noisy marginals, fit a
graphical model to the sums, sample rows from it.

Each site releases its own marginals with Gaussian noise (``common.marginals.marginal_counts``
through the node's release path); the server adds them up. Their sum is the marginal of the union
of the sites' rows plus Gaussian noise whose variance is the sum of the sites' variances, so it is
one measurement of the pooled data, which Private-PGM (``mbi``) fits exactly like a central
measurement: everything here is post-processing of what the sites released.

Written by hand: summing and the variance bookkeeping are three lines; the estimation and the
sampling are mbi's (``MirrorDescent``, ``synthetic_data``), as in the MST and AIM baselines.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

Clique = tuple[str, ...]
# mirror-descent iterations of the final model: the MST reference's count
ESTIMATE_ITERS = 10000


@dataclass(frozen=True)
class Measured:
    """One marginal of the pooled rows as the server knows it: the sum of the sites' noisy counts
    and the standard deviation of that sum's noise (per cell)."""

    clique: Clique
    counts: np.ndarray
    stddev: float


def sum_marginals(answers: Sequence[Mapping[Clique, np.ndarray]], stddevs: Sequence[float]) -> list[Measured]:
    """The pooled measurement of each clique every site answered: in each site's noisy marginals
    (clique -> counts) and the stddev of its noise, out the summed counts with stddev
    sqrt(sum of the sites' variances). A clique some site did not answer is left out: a sum over
    fewer sites is a marginal of other rows."""
    if len(answers) != len(stddevs):
        raise ValueError(f"{len(answers)} sites' answers but {len(stddevs)} noise levels")
    if not answers:
        return []
    common = [c for c in answers[0] if all(c in a for a in answers[1:])]
    out = []
    for clique in common:
        shapes = {np.shape(a[clique]) for a in answers}
        if len(shapes) != 1:
            raise ValueError(f"clique {clique}: the sites' marginals have different shapes {sorted(shapes)}")
        out.append(Measured(clique, np.sum([np.asarray(a[clique], dtype=np.float64) for a in answers], axis=0),
                            math.sqrt(sum(float(s) ** 2 for s in stddevs))))
    return out


def fit_and_sample(sizes: Mapping[str, int], measured: Sequence[Measured], rows: int, seed: int,
                   iters: int = ESTIMATE_ITERS) -> pd.DataFrame:
    """Rows drawn from the graphical model that best explains ``measured``: in each column's
    domain size (columns in order), the pooled measurements and how many rows to draw; out one
    int64 column of bin indices per column (``common.marginals.undiscretise`` turns them back
    into values). The total is mbi's minimum-variance estimate from the measurements."""
    import jax

    jax.config.update("jax_enable_x64", True)  # mbi's estimators stall in float32 on larger counts
    from mbi import Domain, LinearMeasurement
    from mbi.estimation import MirrorDescent, minimum_variance_unbiased_total
    from mbi.extensions import synthetic_data

    if rows < 1:
        raise ValueError("rows must be >= 1")
    attrs = list(sizes)
    domain = Domain(attrs, [int(sizes[a]) for a in attrs])
    loss = [LinearMeasurement(m.counts, m.clique, stddev=m.stddev) for m in measured]
    model = MirrorDescent().estimate(domain, loss, known_total=max(1.0, minimum_variance_unbiased_total(loss)),
                                     iters=iters)
    sampled = synthetic_data(model, rows, seed=int(seed)).to_dict()
    return pd.DataFrame({a: np.asarray(sampled[a], dtype=np.int64) for a in attrs}, columns=attrs)
