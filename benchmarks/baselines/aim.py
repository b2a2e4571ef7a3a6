"""AIM: the differentially private synthetic-table baseline of McKenna, Mullins, Sheldon and Miklau
(2022), "AIM: An Adaptive and Iterative Mechanism for Differentially Private Synthetic Data"
(PVLDB 15(11)), on Private-PGM (``mbi`` 2.0).

The algorithm follows the paper's Algorithm 1 step for step as ``mechanisms/aim.py`` of
github.com/ryan112358/private-pgm implements it (credit: its authors); the code is written anew
here for mbi 2.0's API and this project's conventions:

1. (epsilon, delta) -> zCDP rho (``cdp_rho``). The workload is every marginal of ``degree``
   columns (all pairs by default), each of weight 1; the candidates are its downward closure,
   a candidate's weight the workload weight it shares attributes with (``candidate_weights``).
2. The budget (``initial_budget``, ``next_round``): T = 16 d nominal rounds; a round measures one
   marginal with Gaussian noise of stddev sigma = sqrt(T / (2 * 0.9 rho)) and selects it with an
   exponential mechanism of epsilon = sqrt(8 * 0.1 rho / T): 0.9 rho / T + 0.1 rho / T = rho / T
   per round. The initialisation measures the d 1-way marginals at that sigma (d * 0.9 rho / T).
3. Each round: when less than twice a round's cost is left, the round spends all that is left
   (90 % noise, 10 % selection) and is the last. The candidates are those whose addition keeps
   the model's junction tree within ``max_model_size`` * (rho spent / rho) megabytes (or that the
   model already covers); among them the exponential mechanism picks on the quality
   w_c * (||x_c - model_c||_1 - sqrt(2 / pi) * sigma * n_c) (sensitivity max w_c), the candidate
   is measured, and the model re-estimated by mirror descent warm-started from its potentials
   (``ROUND_ITERS`` steps, where the reference runs ``max_iters``: see there).
   When the new estimate of the measured marginal moved less than the noise's expected L1 size
   (sqrt(2 / pi) * sigma * n_c), sigma halves and epsilon doubles (annealing: 4x the rho a round).
4. A final estimate of ``max_iters`` steps, records sampled from it (mbi's seeded sampler).

Sensitivities are for add/remove-one-record neighbours, as in ``mst``: one record changes a
marginal by one in one cell (L2 sensitivity 1), and a quality score by at most w_c.

Discretisation, undiscretisation, the conversion to rho, the exponential mechanism and the output
types are ``mst``'s, imported from it: a table goes in and comes out exactly as with MST.

jax and mbi are imported inside ``aim_synthesise`` only: the module imports without them.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from benchmarks.baselines.mst import exponential_mechanism, prepare
from common.marginals import typed_like, undiscretise
from common.rows import Schema

# The reference's constants: T = 16 d nominal rounds, 90 % of a round's rho for its measurement
# and 10 % for its selection.
ROUNDS_PER_ATTRIBUTE = 16
MEASURE_SHARE = 0.9

# Mirror-descent iterations in the rounds (the initial model and each warm-started
# re-estimate). The reference runs ``max_iters`` (1,000) every round; each round here starts from
# the previous round's potentials and adds one marginal, so it starts near its optimum, and 200
# steps (4 of mbi's fused 50-step blocks) is the cap. On the 4-column, 400-row, epsilon = 8 test
# table both caps take about 20 s (jax's compilation, one per round, dominates); on 6 columns x
# 3,000 rows at epsilon = 50 200 took about 2 minutes on two loaded CPU cores and 1,000 more than
# 18 (stopped there): more steps cost more per round and, likely, a better-fitted model moves
# more after a measurement, so annealing fires later and more of the up to 16 d rounds run. The cap
# changes which marginals get measured (through the annealing test) but no privacy accounting:
# the estimates are post-processing. The final estimate runs ``max_iters``.
ROUND_ITERS = 200


# --- the workload --------------------------------------------------------------------------------

Clique = tuple[str, ...]


def workload(attributes: Sequence[str], degree: int) -> list[tuple[Clique, float]]:
    """AIM's default workload: in the attributes and the marginals' degree (>= 1; more than the
    attributes means all of them), out every marginal of that many attributes, in the
    attributes' order, with weight 1."""
    if degree < 1:
        raise ValueError("degree must be >= 1")
    return [(cl, 1.0) for cl in itertools.combinations(attributes, min(degree, len(attributes)))]


def candidate_weights(work: Sequence[tuple[Clique, float]], attributes: Sequence[str]) -> dict[Clique, float]:
    """The candidates and their weights (the reference's ``compile_workload``): in a workload of
    (clique, weight) and the attributes (for a fixed order), out every non-empty subset of a
    workload clique, weighted by sum over the workload of weight * (attributes in common),
    ordered by size then by the attributes' order (the order the exponential mechanism draws
    in: fixed, so that a seed gives the same draw in every process)."""
    position = {a: i for i, a in enumerate(attributes)}
    closure: set[Clique] = set()
    for cl, _ in work:
        ordered = tuple(sorted(cl, key=position.__getitem__))
        for r in range(1, len(ordered) + 1):
            closure.update(itertools.combinations(ordered, r))
    ordered_closure = sorted(closure, key=lambda cl: (len(cl), [position[a] for a in cl]))
    return {cl: float(sum(w * len(set(cl) & set(wcl)) for wcl, w in work)) for cl in ordered_closure}


# --- the budget ----------------------------------------------------------------------------------

def round_rho(sigma: float, epsilon: float) -> float:
    """The zCDP rho of one round: a Gaussian measurement of sensitivity 1 at stddev ``sigma``
    (1 / (2 sigma^2)) and an exponential mechanism at ``epsilon`` (epsilon^2 / 8)."""
    return 0.5 / sigma**2 + epsilon**2 / 8.0


def initial_budget(rho: float, attributes: int) -> tuple[float, float, float]:
    """The start of the schedule: in the total rho (> 0) and the number of attributes d (the
    1-way marginals measured first), out (sigma, epsilon, rho spent by the 1-way measurements).
    T = 16 d nominal rounds, each 0.9 rho / T of noise and 0.1 rho / T of selection."""
    if not rho > 0 or attributes < 1:
        raise ValueError("rho must be > 0 and there must be at least one attribute")
    rounds = ROUNDS_PER_ATTRIBUTE * attributes
    sigma = math.sqrt(rounds / (2 * MEASURE_SHARE * rho))
    epsilon = math.sqrt(8 * (1 - MEASURE_SHARE) * rho / rounds)
    return sigma, epsilon, attributes * 0.5 / sigma**2


def next_round(rho: float, used: float, sigma: float, epsilon: float) -> tuple[float, float, float, bool]:
    """One round's budget: in the total rho, the rho spent so far, and the current (annealed)
    sigma and epsilon; out (sigma, epsilon, rho spent after this round, whether it is the last).
    When less than two rounds' worth is left, this round takes all of it, 90 % for the noise and
    10 % for the selection (the reference's rule), so the total never passes rho."""
    if rho - used < 2 * round_rho(sigma, epsilon):
        remaining = rho - used
        if not remaining > 0:
            raise ValueError("no budget left for a round")
        sigma = math.sqrt(1 / (2 * MEASURE_SHARE * remaining))
        epsilon = math.sqrt(8 * (1 - MEASURE_SHARE) * remaining)
        # 1 / (2 sigma^2) + epsilon^2 / 8 is ``remaining`` up to rounding; count it as exactly
        # that, so that the float total lands on rho instead of an ulp past it
        return sigma, epsilon, rho, True
    return sigma, epsilon, used + round_rho(sigma, epsilon), False


def anneal(sigma: float, epsilon: float) -> tuple[float, float]:
    """The reference's annealing step: half the noise, twice the selection epsilon (4x the rho
    of a round), used when the last measurement barely moved the model."""
    return sigma / 2, epsilon * 2


# --- the private steps ---------------------------------------------------------------------------

def _downward_closure(cliques: Sequence[Sequence[str]]) -> set[frozenset[str]]:
    return {frozenset(sub) for cl in cliques for r in range(1, len(cl) + 1)
            for sub in itertools.combinations(cl, r)}


def within_size(candidates: Mapping[Clique, float], domain: Any, cliques: Sequence[Sequence[str]],
                limit_mb: float) -> dict[Clique, float]:
    """The reference's ``filter_candidates``: in the candidates, the mbi ``Domain``, the model's
    cliques and the size limit in megabytes, out the candidates whose addition keeps the junction
    tree's tables within the limit (mbi's ``hypothetical_model_size``), or that a model clique
    already contains (free to ask about)."""
    from mbi.junction_tree import hypothetical_model_size

    free = _downward_closure(cliques)
    return {cl: w for cl, w in candidates.items()
            if frozenset(cl) in free or hypothetical_model_size(domain, list(cliques) + [cl]) <= limit_mb}


@functools.cache
def _batched_elimination() -> Any:
    """One jitted program computing many out-of-model marginals (mbi's variable elimination for
    each clique). ``MarkovRandomField.project`` compiles one program per clique, and the model's
    structure changes every round: 30-odd compilations a round on 8 columns, where one will do."""
    import jax
    from mbi.marginal_oracles import variable_elimination

    def eliminate(potentials: Any, total: Any, cliques: tuple[Clique, ...]) -> list[Any]:
        return [variable_elimination(potentials, cl, total) for cl in cliques]

    return jax.jit(eliminate, static_argnames="cliques")


def _sum_to(values: np.ndarray, attrs: Sequence[str], clique: Clique) -> np.ndarray:
    """A table over ``attrs`` summed down to ``clique``, flat in the clique's attribute order."""
    summed = values.sum(axis=tuple(i for i, a in enumerate(attrs) if a not in clique))
    kept = [a for a in attrs if a in clique]
    return np.transpose(summed, [kept.index(a) for a in clique]).ravel()


def model_marginals(model: Any, cliques: Sequence[Clique]) -> dict[Clique, np.ndarray]:
    """The model's marginals on ``cliques``, flat, in each clique's attribute order: in an mbi
    ``MarkovRandomField`` and the cliques, out what ``model.project(cl).datavector()`` gives. A
    clique inside one of the model's is summed from that marginal in numpy (jax's eager
    operations compile one small program per shape); the others are computed together in one
    program."""
    tables = {tuple(f.domain.attributes): np.asarray(f.values, dtype=float) for f in model.marginals.tables.values()}
    out: dict[Clique, np.ndarray] = {}
    outside = []
    for cl in cliques:
        home = next((attrs for attrs in tables if set(cl) <= set(attrs)), None)
        if home is None:
            outside.append(cl)
        else:
            out[cl] = _sum_to(tables[home], home, cl)
    if outside:
        factors = _batched_elimination()(model.potentials, float(model.total), tuple(outside))
        out.update({cl: _sum_to(np.asarray(f.values, dtype=float), tuple(f.domain.attributes), cl)
                    for cl, f in zip(outside, factors)})
    return {cl: out[cl] for cl in cliques}


def select_marginal(candidates: Mapping[Clique, float], answers: Mapping[Clique, np.ndarray],
                    estimates: Mapping[Clique, np.ndarray], sizes: Mapping[Clique, int], sigma: float,
                    epsilon: float, rng: np.random.Generator) -> Clique:
    """The reference's ``worst_approximated``: in the candidates with their weights, the true and
    the model's marginals (flat, in the same cell order), the marginals' cell counts, this round's
    sigma and epsilon; out the candidate drawn by the exponential mechanism on
    w_c * (||x_c - model_c||_1 - sqrt(2 / pi) * sigma * n_c), of sensitivity max |w_c|. The
    subtracted term is the expected L1 size of the noise the measurement would add: a marginal
    already estimated to within that is not worth measuring."""
    keys = list(candidates)
    scores = np.array([candidates[cl] * (np.abs(answers[cl] - estimates[cl]).sum()
                                         - math.sqrt(2 / math.pi) * sigma * sizes[cl]) for cl in keys])
    sensitivity = max(abs(candidates[cl]) for cl in keys)
    return keys[exponential_mechanism(scores, epsilon, sensitivity, rng)]


def aim_synthesise(frame: pd.DataFrame, schema: Schema, epsilon: float, delta: float, rows: int, seed: int,
                   bins: int = 16, degree: int = 2, max_model_size: float = 80.0,
                   max_iters: int = 1000) -> pd.DataFrame:
    """``rows`` synthetic records from AIM at (epsilon, delta)-DP: in the private records (the
    schema's columns, typed), the schema (public: its categories and declared ranges define the
    domain), the budget, the number of rows to make, a seed (the same seed and input give the same
    frame), the bins per number or date column, the workload's degree (all marginals of that many
    columns), the largest model in megabytes (the reference's 80) and the final estimate's
    mirror-descent iterations; out a DataFrame with the schema's columns in its order, typed like
    the input, every value inside the schema."""
    if degree < 1 or not max_model_size > 0 or max_iters < 1:
        raise ValueError("AIM needs degree >= 1, max_model_size > 0 and max_iters >= 1")
    attrs, domain, data, rho = prepare("AIM", frame, schema, epsilon, delta, rows, bins)
    from mbi import LinearMeasurement
    from mbi.estimation import MirrorDescent
    from mbi.extensions import synthetic_data

    rng = np.random.default_rng(seed)

    candidates = candidate_weights(workload(attrs, degree), attrs)
    answers = {cl: np.asarray(data.project(cl).datavector(), dtype=float) for cl in candidates}
    sizes = {cl: int(domain.size(cl)) for cl in candidates}
    round_iters = min(ROUND_ITERS, max_iters)

    def measure(cl: Clique, stddev: float) -> Any:
        x = answers[cl]
        return LinearMeasurement(x + rng.normal(0.0, stddev, size=x.shape), cl, stddev=stddev)

    # 1. every 1-way marginal, at the rounds' sigma
    sigma, select_eps, used = initial_budget(rho, len(attrs))
    measurements = [measure(cl, sigma) for cl in candidates if len(cl) == 1]
    model = MirrorDescent().estimate(domain, measurements, iters=round_iters)

    # 2. the rounds, until the budget is spent
    last = False
    while not last:
        sigma, select_eps, used, last = next_round(rho, used, sigma, select_eps)
        allowed = within_size(candidates, domain, model.cliques, max_model_size * used / rho)
        estimates = model_marginals(model, list(allowed))
        cl = select_marginal(allowed, answers, estimates, sizes, sigma, select_eps, rng)
        measurements.append(measure(cl, sigma))
        before = estimates[cl]
        model = MirrorDescent().estimate(domain, measurements, iters=round_iters, warm_start=model)
        after = model_marginals(model, [cl])[cl]
        if np.abs(after - before).sum() <= math.sqrt(2 / math.pi) * sigma * sizes[cl]:
            sigma, select_eps = anneal(sigma, select_eps)

    # 3. the final model, and records from it
    model = MirrorDescent().estimate(domain, measurements, iters=max_iters, warm_start=model)
    sampled = synthetic_data(model, rows, seed=int(rng.integers(2**31 - 1)))
    result = {a: np.asarray(sampled.to_dict()[a], dtype=np.int64) for a in attrs}
    out = undiscretise(pd.DataFrame(result, columns=attrs), schema, bins, rng)
    return typed_like(out, frame, schema)
