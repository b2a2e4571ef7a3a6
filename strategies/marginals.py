"""A table by federated marginals (issue 48): every site counts, the server fits and samples.

``MarginalsStrategy.start`` is this method's whole server logic, top to bottom:

0. tiers      -- as in every run (``strategies.fedsyn``): each node's tier and whether its ledger
                 and policy cover the run's one phase, ``marginals`` (its whole epsilon)
M. marginals  -- in place of a text run's stage 2 (the profile), ``marginal-rounds`` rounds; in
                 each, every site (strong and weak alike) releases the counts of the round's
                 marginals over the public schema's bins with Gaussian noise (one release, L2 sensitivity
                 sqrt(marginals), ``fedsyn_client.histograms``),
                 at 1 / rounds of its epsilon and delta. The server sums the sites' vectors: a
                 measurement of the pooled rows with the sites' variances added. What round 2
                 measures is chosen from round 1's sums (``strategies.graphical_model``: free)
   fit        -- Private-PGM's graphical model fitted to the sums, rows sampled from it, written
                 as the table's records (the outputs, the report and the metrics as for rows);
                 as many as a text run's final set (``strategies.refinement.final_size``)
1-4. the free text -- only for a table with a free-text column: a text run's stages
                 (``strategies.text_stages.TextStages``) write it, their stage 2 the sampled rows'
                 codes (no site is asked a profile), their vote rounds numbered after the marginals
                 rounds; each sampled row is given a text of its own code
5. ledgers    -- every node states this run's releases from its own ledger (free)

Nodes, holds, failures, degradations and checkpoints are the ``RunSession``'s, as in a text run
(``strategies.session``; this class composes it, and holds the text stages only when there is a
free-text column): a site that fails a round is left out of that round's sum, which is then a
marginal of fewer sites' rows and is said as a degradation.
"""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, RecordDict
from flwr.serverapp import Grid

from common import records as R
from common.codes import make_code
from common.config import ConfigError, RunConfig
from common.dp import MARGINALS, PROFILE
from common.logs import get_logger
from common.marginals import cells, column_sizes, split_marginals, undiscretise
from common.rows import generated_part, join_record, serialise
from strategies.allocation import allocate
from strategies.checkpoint import Checkpoint
from strategies.graphical_model import Clique, Measured, first_round, fit_and_sample, model_measurements, second_round
from strategies.refinement import Generator, Refinement, final_size
from strategies.result import FedSynResult
from strategies.secagg_rounds import SecureSum, secure
from strategies.session import Orchestration, RoundUnanswered, RunSession
from strategies.text_stages import EvaluateFn, TextStages

log = get_logger("fedsyn")
WRITER = "marginals"  # each row's writer in pool.jsonl and the writers' summary: the graphical model
TEXTS = "free-text"  # the checkpoint's mark that the rows have their free text


def planned_marginals(cfg: RunConfig) -> list[int]:
    """How many marginals each round asks of every site (public: from the schema alone; round 2
    measures a tree over the non-control columns, with the control column, whatever the data)."""
    schema = cfg.schema()
    columns = list(schema.structured().names) if schema is not None else []
    first = len(first_round(columns, cfg.control_columns[0], cfg.marginal_rounds))
    return [first] if cfg.marginal_rounds == 1 else [first, max(1, len(columns) - 2)]


class MarginalsStrategy(Orchestration):
    """Federated noisy marginals + a graphical model on the server (``table-method = "marginals"``).

    ``cfg``: a table run's config; ``vocabulary``: the public control codes; ``delta``: per release.
    Without a free-text column no language model takes part and the text plug-ins must be left
    out. With one, ``make_aggregator``, ``refinement``, ``generator`` and ``evaluate_fn`` are a text
    run's (``TextStages``) and write it (``generator`` None only for stage 0 alone, ``fedsyn plan``).
    Raises ``ValueError`` on a config that is not a marginals table run, or text plug-ins that do
    not match the free-text column; ``ConfigError`` when Private-PGM is missing."""

    def __init__(self, cfg: RunConfig, vocabulary: list[str], delta: float, stable_seconds: float = 3.0,
                 generator: Generator | None = None, refinement: Refinement | None = None,
                 make_aggregator: Callable[[int], Any] | None = None,
                 evaluate_fn: EvaluateFn | None = None) -> None:
        schema = cfg.schema()
        if schema is None or not cfg.marginals:
            raise ValueError("MarginalsStrategy needs a table run with table-method = 'marginals'")
        if importlib.util.find_spec("mbi") is None:  # before any site is asked: nothing spent on a run that cannot end
            raise ConfigError("table-method = 'marginals' needs Private-PGM on the server to fit its model: "
                              "pip install 'fedsyn[tables]' (the sites only count; they do not need it), or "
                              "let the language model write the rows: table-method = 'rows'")
        self.cfg, self.vocabulary = cfg, list(vocabulary)
        self.schema, self.sizes = schema, column_sizes(schema, cfg.marginal_bins)
        self.anchor = cfg.control_columns[0]
        self.session = RunSession(cfg, vocabulary, delta, phases=self.phases, stable_seconds=stable_seconds)
        self._round = 0  # the marginals rounds asked so far (the checkpoint's vote_totals start with them)
        self.text: TextStages | None = None  # the free-text column's stages 1-4, if the table has one
        if cfg.free_text is not None:
            if refinement is None or make_aggregator is None:
                raise ValueError(f"a free-text column ({cfg.free_text!r}) needs the text stages' refinement and "
                                 "aggregator")
            self.text = TextStages(self.session, make_aggregator, refinement, generator, evaluate_fn,
                                   allocate=self._allocate_from_rows, rounds_before=cfg.marginal_rounds)
        elif refinement is not None or generator is not None:
            raise ValueError("a table without a free-text column takes no language model, refinement or aggregator")

    def summary(self) -> None:
        """Log the run's shape."""
        c = self.cfg
        log.info("fedsyn: table by federated marginals: %d columns, %d bins, %d round(s), eps=%s per site, %d rows",
                 len(self.sizes), c.marginal_bins, c.marginal_rounds, c.epsilon, final_size(c))
        if c.free_text is not None:
            log.info("free-text column %r: written by %s from each row's code (%s), %.0f%% of every site's "
                     "epsilon for the marginals", c.free_text, c.model, ", ".join(c.control_columns),
                     100 * c.marginals_share)
        if not c.private:
            log.warning("epsilon = inf: NO DIFFERENTIAL PRIVACY. Sites release exact marginals; use this only "
                        "as a baseline on public data.")

    def phases(self) -> list[str]:
        """The marginals, then the text stages' phases but the profile (the rows allocate the texts)."""
        text = [p for p in self.text.phases() if p not in (PROFILE, MARGINALS)] if self.text is not None else []
        return [MARGINALS] + text

    # ------------------------------------------------------------- the phases
    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None,
              resume: Checkpoint | None = None) -> FedSynResult:
        """Stages 0, M (and 1-4 for a free-text column, from ``initial_arrays``) and 5 over
        ``grid``; with ``resume`` continue where the checkpoint stopped. Returns the result."""
        self.summary()
        session = self.session
        t0 = session.begin(grid, resume)                                # stage 0
        res, t = session.result, time.time()                            # stage M
        if MARGINALS not in session.progress.completed:
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
            session.checkpoint(MARGINALS)
            res.timings[MARGINALS] = time.time() - t
        assert res.selected is not None, "stage M (above, or restored from the checkpoint with it) sets the rows"
        log.info("final synthetic table: %d rows (%d marginals measured in %d round(s))", len(res.selected),
                 sum(len(r["cliques"]) for r in res.vote_rounds if "cliques" in r), len(res.vote_rounds))

        if self.text is not None and TEXTS not in session.progress.completed:
            self.text.write(grid, initial_arrays)                       # stages 1-4, the free text
            self._attach_texts()
            session.checkpoint(TEXTS)
        return session.finish(grid, t0)                                 # stage 5

    def _measure(self, cliques: list[Clique]) -> list[Measured]:
        """One round: every site's noisy marginals of ``cliques``, summed, with
        the sum's noise from each site's stated sigma. A finished round comes from the checkpoint."""
        session = self.session
        self._round += 1
        rnd, share = self._round, 1.0 / self.cfg.marginal_rounds
        if rnd <= len(session.progress.vote_totals):
            log.info("marginals round %d: taken from the checkpoint", rnd)
            stored_stddev, *stored = session.progress.vote_totals[rnd - 1]
            return self._measured(np.asarray(stored), float(stored_stddev), cliques)
        grid = session.run_grid()
        session.members.admit(grid, f"before marginals round {rnd}")
        sites = sorted(session.members.active())
        content = RecordDict({R.CONFIG: session.request(**{R.CLIQUES: R.cliques_value(cliques), "epsilon-share": share,
                                                          "server-round": rnd})})
        length = sum(cells(c, self.sizes) for c in cliques)
        if secure(session.result.trust, sites):  # some site shares the noise: the server sees the sum alone
            masked = SecureSum(session.courier, session.result.bounds).run(grid, sites, R.MSG_MARGINALS, MARGINALS,
                                                                           content, length)
            answered: dict[int, Any] = dict.fromkeys(masked.survivors if masked else ())
        else:
            masked = None
            replies = session.courier.ask(grid, sites, R.MSG_MARGINALS, MARGINALS, content)
            vectors = session.courier.vectors(replies, R.MARGINALS, length, MARGINALS)
            sigmas = {n: self._sigma(n, replies[n]) for n in vectors}
            stated = {n: s for n, s in sigmas.items() if s is not None}
            answered = {n: v for n, v in vectors.items() if n in stated}
        session.courier.coverage(f"marginals round {rnd}", answered, sites)
        if not answered:
            raise RoundUnanswered(f"marginals round {rnd}: no site answered (see failures above); the run stops "
                                  "before this round with its checkpoint: resume it when the sites are back "
                                  "(flwr run . --run-config <run-dir>/resume.toml)")
        if masked is not None:
            total, stddev = masked.total, masked.stddev
        else:
            total = np.sum([np.asarray(v) for v in answered.values()], axis=0)
            stddev = math.sqrt(sum(float(stated[n]) ** 2 for n in answered))
        session.result.vote_rounds.append({"round": rnd, "histogram": MARGINALS, "epsilon_share": share,
                                        "cliques": ["|".join(c) for c in cliques], "voters": sorted(answered),
                                        "stddev": stddev})
        session.progress.vote_totals.append([stddev, *(float(v) for v in total)])
        session.checkpoint()
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
            self.session.courier.fail(node_id, MARGINALS, "malformed reply: no noise stated", stated=True)
            return None
        return sigma

    def _sample(self, measured: list[Measured], model: list[Clique]) -> None:
        """Fit the graphical model to ``measured``, sample the final rows, and keep them as the
        run's records: each row's text its generated columns (``common.rows.serialise``), its
        code its control columns, as a node's records are. With a free-text column the rows wait
        in ``table_rows`` for their text (``_attach_texts``)."""
        rows = final_size(self.cfg)
        codes = fit_and_sample(self.sizes, measured, rows, seed=self.cfg.seed)
        rng = np.random.default_rng(self.cfg.seed)
        counted = self.schema.structured()
        frame = undiscretise(codes, counted, self.cfg.marginal_bins, rng)
        generated = generated_part(counted, self.cfg.control_columns)
        res = self.session.result
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
    def _allocate_from_rows(self) -> None:
        """Stage 2 for the free text (``TextStages``'s ``allocate``): the pool per code in proportion
        to the sampled rows' codes. Post-processing of the marginals, so no site is asked for a
        profile (and none spends on one)."""
        assert self.text is not None  # only the text stages call it
        res = self.session.result
        counts = np.array([sum(1 for _, c in res.table_rows if c == code) for code in self.vocabulary],
                          dtype=float)
        res.profile = counts
        res.allocation = dict(zip(self.vocabulary,
                                  (int(a) for a in allocate(counts, self.text.refinement.pool_size(self.cfg)))))
        log.info("the sampled rows' codes %s -> the text pool's allocation %s", counts.astype(int).tolist(),
                 res.allocation)

    def _attach_texts(self) -> None:
        """Give every sampled row a final text of its own code: each code's texts in a random order,
        again from the start when the code has more rows than texts. A row whose code got no text is
        left out and said as a degradation (a text of another code would contradict its row)."""
        assert self.text is not None  # only for a free-text column
        res = self.session.result
        rng = np.random.default_rng([self.cfg.seed, 48])
        assert res.selected is not None, "stage M sets the rows before the free text is attached"
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
            self.session.courier.degrade(f"{textless} of {len(res.table_rows)} sampled rows left out: their code "
                                         "got no text from the language model")
        # the refinement's notes replaced the marginals' (stage 4 ran after them): both are kept
        model = [c for c in next(r for r in reversed(res.vote_rounds) if r.get("histogram") == MARGINALS)["cliques"]
                 if "|" in c]
        res.refinement = {"method": "marginals", "model_cliques": model, "free_text": self.cfg.free_text,
                          "rows_with_text": len(texts),
                          "texts_reused": sum(max(0, used[c] - len(order[c])) for c in used),
                          "text_refinement": {"method": self.text.refinement.name, **res.refinement}}
        res.pool_texts, res.pool_codes, res.pool_writers = texts, codes, writers
        res.votes = np.asarray(votes) if res.votes is not None else None
        res.selected = np.arange(len(texts), dtype=np.int64)
        res.allocation = {c: codes.count(c) for c in self.vocabulary}
