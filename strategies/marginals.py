"""A table by federated marginals (issue 48): every site counts, the server fits and samples.

``MarginalsStrategy.run`` is this method's whole server logic, top to bottom:

0. tiers      -- as in every run (``strategies.fedsyn``): each node's tier and whether its ledger
                 and policy cover the run's one phase, ``marginals`` (its whole epsilon)
M. marginals  -- ``marginal-rounds`` rounds; in each, every site (strong and weak alike) releases
                 the counts of the round's marginals over the public schema's bins with Gaussian
                 noise (one release, L2 sensitivity sqrt(marginals), ``fedsyn_client.histograms``),
                 at 1 / rounds of its epsilon and delta. The server sums the sites' vectors: a
                 measurement of the pooled rows with the sites' variances added. What round 2
                 measures is chosen from round 1's sums (``strategies.graphical_model``: free)
   fit        -- Private-PGM's graphical model fitted to the sums, rows sampled from it, written
                 as the table's records (the outputs, the report and the metrics as for rows)
5. ledgers    -- every node states this run's releases from its own ledger (free)

Nodes, holds, failures, degradations and checkpoints are ``FedSynStrategy``'s (this class only
replaces its phases): a site that fails a round is left out of that round's sum, which is then a
marginal of fewer sites' rows and is said as a degradation.
"""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.serverapp import Grid

from common import records as R
from common.codes import make_code
from common.config import ConfigError, RunConfig
from common.dp import MARGINALS, PROFILE
from common.logs import get_logger
from common.marginals import cells, column_sizes, split_marginals, undiscretise
from common.rows import generated_part, join_record, serialise
from strategies.checkpoint import Checkpoint
from strategies.allocation import allocate
from strategies.fedsyn import FedSynStrategy, RoundUnanswered
from strategies.refinement import Generator, Refinement
from strategies.graphical_model import Clique, Measured, first_round, fit_and_sample, model_measurements, second_round
from strategies.result import FedSynResult

log = get_logger("fedsyn")
WRITER = "marginals"  # each row's writer in pool.jsonl and the writers' summary: the graphical model
TEXTS = "free-text"  # the checkpoint's mark that the rows have their free text


def final_rows(cfg: RunConfig) -> int:
    """How many rows a marginals run samples: the final set's size of a text run
    (num-synthetic x sampling-rate), so methods compare at the same size."""
    return max(1, round(cfg.num_synthetic * cfg.sampling_rate))


def planned_marginals(cfg: RunConfig) -> list[int]:
    """How many marginals each round asks of every site (public: from the schema alone; round 2
    measures a tree over the non-control columns, with the control column, whatever the data)."""
    schema = cfg.schema()
    columns = list(schema.structured().names) if schema is not None else []
    first = len(first_round(columns, cfg.control_columns[0], cfg.marginal_rounds))
    return [first] if cfg.marginal_rounds == 1 else [first, max(1, len(columns) - 2)]


class MarginalsStrategy(FedSynStrategy):
    """Federated noisy marginals + a graphical model on the server (``table-method = "marginals"``).

    Without a free-text column no language model takes part. With one, the text strategy's
    ``make_aggregator``, ``refinement``, ``generator`` and ``evaluate_fn`` write it (``generator``
    None only for stage 0 alone, ``fedsyn plan``)."""

    def __init__(self, cfg: RunConfig, vocabulary: list[str], delta: float, stable_seconds: float = 3.0,
                 generator: Generator | None = None, refinement: Refinement | None = None,
                 make_aggregator: Callable[[int], Any] | None = None,
                 evaluate_fn: Callable[[int, ArrayRecord], float] | None = None) -> None:
        from strategies.aggregators import build_aggregator
        from strategies.refinement import build_refinement

        super().__init__(cfg, vocabulary,
                         make_aggregator=make_aggregator or (lambda n: build_aggregator("fedavg", 1.0, n)),
                         refinement=refinement or build_refinement("none"), generator=generator,  # type: ignore[arg-type]
                         delta=delta, evaluate_fn=evaluate_fn, stable_seconds=stable_seconds)
        schema = cfg.schema()
        if schema is None or not cfg.marginals:
            raise ValueError("MarginalsStrategy needs a table run with table-method = 'marginals'")
        if importlib.util.find_spec("mbi") is None:  # before any site is asked: nothing spent on a run that cannot end
            raise ConfigError("table-method = 'marginals' needs Private-PGM on the server to fit its model: "
                              "pip install 'fedsyn[tables]' (the sites only count; they do not need it), or "
                              "let the language model write the rows: table-method = 'rows'")
        self.schema, self.sizes = schema, column_sizes(schema, cfg.marginal_bins)
        self.anchor = cfg.control_columns[0]

    def summary(self) -> None:
        """Log the run's shape."""
        c = self.cfg
        log.info("fedsyn: table by federated marginals: %d columns, %d bins, %d round(s), eps=%s per site, %d rows",
                 len(self.sizes), c.marginal_bins, c.marginal_rounds, c.epsilon, final_rows(c))
        if c.free_text is not None:
            log.info("free-text column %r: written by %s from each row's code (%s), %.0f%% of every site's "
                     "epsilon for the marginals", c.free_text, c.model, ", ".join(c.control_columns),
                     100 * c.marginals_share)
        if not c.private:
            log.warning("epsilon = inf: NO DIFFERENTIAL PRIVACY. Sites release exact marginals; use this only "
                        "as a baseline on public data.")

    def _plan(self) -> list[str]:
        text = [p for p in super()._plan() if p not in (PROFILE, MARGINALS)] if self.cfg.free_text is not None else []
        return [MARGINALS] + text

    def _rounds_before_refine(self) -> int:
        return self.cfg.marginal_rounds

    # ------------------------------------------------------------- the phases
    def run(self, grid: Grid, initial_arrays: ArrayRecord | None = None, resume: Checkpoint | None = None) -> FedSynResult:
        """Stages 0, M (and 1-4 for a free-text column) and 5; with ``resume`` continue where the
        checkpoint stopped."""
        t0 = self._begin(grid, resume)                                  # stage 0
        res, t = self.result, time.time()                               # stage M
        if MARGINALS not in self.progress.completed:
            columns = list(self.sizes)
            cliques = first_round(columns, self.anchor, self.cfg.marginal_rounds)
            measured = self._measure(cliques)
            if self.cfg.marginal_rounds >= 2:
                model = second_round(measured, columns, self.anchor, self.sizes)
                log.info("round 2 measures %s", ["|".join(c) for c in model])
                measured += self._measure(model)
            else:
                model = [c for c in cliques if len(c) > 1]
            self._sample(model_measurements(measured, model), model)
            self._checkpoint(MARGINALS)
            res.timings[MARGINALS] = time.time() - t
        log.info("final synthetic table: %d rows (%d marginals measured in %d round(s))", len(res.selected),
                 sum(len(r["cliques"]) for r in res.vote_rounds if "cliques" in r), len(res.vote_rounds))

        if self.cfg.free_text is not None and TEXTS not in self.progress.completed:
            self._write_texts(grid, initial_arrays)                     # stages 1-4, the free text
            self._attach_texts()
            self._checkpoint(TEXTS)
        return self._finish(grid, t0)                                   # stage 5

    def _measure(self, cliques: list[Clique]) -> list[Measured]:
        """One round: every site's noisy marginals of ``cliques``, summed, with
        the sum's noise from each site's stated sigma. A finished round comes from the checkpoint."""
        self._vote_round += 1
        rnd, share = self._vote_round, 1.0 / self.cfg.marginal_rounds
        if rnd <= len(self.progress.vote_totals):
            log.info("marginals round %d: taken from the checkpoint", rnd)
            stddev, *total = self.progress.vote_totals[rnd - 1]
            return self._measured(np.asarray(total), float(stddev), cliques)
        self.members.admit(self._grid, f"before marginals round {rnd}")
        sites = sorted(self.members.active())
        replies = self.courier.ask(self._grid, sites, R.MSG_MARGINALS, MARGINALS, RecordDict({
            R.CONFIG: self._request(**{R.CLIQUES: R.cliques_value(cliques), "epsilon-share": share,
                                       "server-round": rnd})}))
        length = sum(cells(c, self.sizes) for c in cliques)
        vectors = self.courier.vectors(replies, R.MARGINALS, length, MARGINALS)
        sigmas = {n: self._sigma(n, replies[n]) for n in vectors}
        answered = {n: v for n, v in vectors.items() if sigmas[n] is not None}
        self.courier.coverage(f"marginals round {rnd}", answered, sites)
        if not answered:
            raise RoundUnanswered(f"marginals round {rnd}: no site answered (see failures above); the run stops "
                                  "before this round with its checkpoint: resume it when the sites are back "
                                  "(flwr run . --run-config <run-dir>/resume.toml)")
        total = np.sum([np.asarray(v) for v in answered.values()], axis=0)
        stddev = math.sqrt(sum(float(sigmas[n]) ** 2 for n in answered))
        self.result.vote_rounds.append({"round": rnd, "histogram": MARGINALS, "epsilon_share": share,
                                        "cliques": ["|".join(c) for c in cliques], "voters": sorted(answered),
                                        "stddev": stddev})
        self.progress.vote_totals.append([stddev, *(float(v) for v in total)])
        self._checkpoint()
        return self._measured(total, stddev, cliques)

    def _measured(self, total: np.ndarray, stddev: float, cliques: list[Clique]) -> list[Measured]:
        """A round's summed vector as one measurement per clique (the sum is ``_measure``'s)."""
        return [Measured(c, counts, stddev) for c, counts in split_marginals(total, cliques, self.sizes).items()]

    def _sigma(self, node_id: int, reply: Any) -> float | None:
        """The noise a site states it added (its release statement's sigma: public); a reply
        without one is a failure of that site (its vector cannot be weighed)."""
        try:
            sigma = float(dict(reply.content.config_records[R.RELEASE])["sigma"])
        except (KeyError, TypeError, ValueError):
            sigma = math.nan
        if not (math.isfinite(sigma) and sigma >= 0):
            self.courier.fail(node_id, MARGINALS, "malformed reply: no noise stated", stated=True)
            return None
        return sigma

    def _sample(self, measured: list[Measured], model: list[Clique]) -> None:
        """Fit the graphical model to ``measured``, sample the final rows, and keep them as the
        run's records: each row's text its generated columns (``common.rows.serialise``), its
        code its control columns, as a node's records are. With a free-text column the rows wait
        in ``table_rows`` for their text (``_attach_texts``)."""
        rows = final_rows(self.cfg)
        codes = fit_and_sample(self.sizes, measured, rows, seed=self.cfg.seed)
        rng = np.random.default_rng(self.cfg.seed)
        counted = self.schema.structured()
        frame = undiscretise(codes, counted, self.cfg.marginal_bins, rng)
        generated = generated_part(counted, self.cfg.control_columns)
        res = self.result
        res.pool_texts, res.pool_codes = [], []
        for row in frame.to_dict("records"):
            res.pool_texts.append(serialise(row, generated, rng))
            res.pool_codes.append(make_code({c: self.schema.column(c).write(row[c]) for c in self.cfg.control_columns},
                                            self.cfg.control_columns))
        res.pool_writers = [WRITER] * len(res.pool_texts)
        res.selected = np.arange(len(res.pool_texts), dtype=np.int64)
        res.allocation = {c: res.pool_codes.count(c) for c in self.vocabulary}
        res.refinement = {"method": "marginals", "model_cliques": ["|".join(c) for c in model],
                          "measurements": len(measured)}
        if self.cfg.free_text is not None:
            res.table_rows = [[t, c] for t, c in zip(res.pool_texts, res.pool_codes)]

    # ------------------------------------------------------------- the free-text column
    def _allocate(self, grid: Grid) -> None:
        """Stage 2 for the free text: the pool per code in proportion to the sampled rows' codes.
        Post-processing of the marginals, so no site is asked for a profile (and none spends on one)."""
        res = self.result
        counts = np.array([sum(1 for _, c in res.table_rows if c == code) for code in self.vocabulary], dtype=float)
        res.profile = counts
        res.allocation = dict(zip(self.vocabulary, (int(a) for a in allocate(counts, self.refinement.pool_size(self.cfg)))))
        log.info("the sampled rows' codes %s -> the text pool's allocation %s", counts.astype(int).tolist(), res.allocation)

    def _attach_texts(self) -> None:
        """Give every sampled row a final text of its own code: each code's texts in a random order,
        again from the start when the code has more rows than texts. A row whose code got no text is
        left out and said as a degradation (a text of another code would contradict its row)."""
        res = self.result
        rng = np.random.default_rng([self.cfg.seed, 48])
        by_code: dict[str, list[int]] = {}
        for i in (int(i) for i in res.selected):
            by_code.setdefault(res.pool_codes[i], []).append(i)
        order = {code: [idx[j] for j in rng.permutation(len(idx))] for code, idx in by_code.items()}
        used: dict[str, int] = {}
        texts, codes, writers, votes, textless = [], [], [], [], 0
        for row_text, code in res.table_rows:
            pool = order.get(code, [])
            if not pool:
                textless += 1
                continue
            i = pool[used.get(code, 0) % len(pool)]
            used[code] = used.get(code, 0) + 1
            texts.append(join_record(row_text, res.pool_texts[i]))
            codes.append(code)
            writers.append(res.pool_writers[i])
            votes.append(float(res.votes[i]) if res.votes is not None and len(res.votes) > i else math.nan)
        if textless:
            self.courier.degrade(f"{textless} of {len(res.table_rows)} sampled rows left out: their code got no "
                                 "text from the language model")
        # the refinement's notes replaced the marginals' (stage 4 ran after them): both are kept
        model = [c for c in next(r for r in reversed(res.vote_rounds) if r.get("histogram") == MARGINALS)["cliques"]
                 if "|" in c]
        res.refinement = {"method": "marginals", "model_cliques": model, "free_text": self.cfg.free_text,
                          "rows_with_text": len(texts), "texts_reused": sum(max(0, used[c] - len(order[c])) for c in used),
                          "text_refinement": {"method": self.refinement.name, **res.refinement}}
        res.pool_texts, res.pool_codes, res.pool_writers = texts, codes, writers
        res.votes = np.asarray(votes) if res.votes is not None else None
        res.selected = np.arange(len(texts), dtype=np.int64)
        res.allocation = {c: codes.count(c) for c in self.vocabulary}
