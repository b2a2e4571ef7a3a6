"""One phase-1 round on a strong node as a mechanism of the release path (A.3 with DP-SGD).

Privacy accounting of phase 1, chosen so that nothing the server sees depends on the records,
neither a number nor whether a round releases (issue 31: no free bits):

- The phase is fixed at its first round. q = min(1, B/|D|) of that round's view (1 for an
  empty view) and the noise multiplier calibrated for the run's whole phase 1 (R rounds x tau
  steps at q) to meet this run's epsilon_train are stored in the ledger with the Opacus
  accountant's state, and every later round samples at that q with that multiplier. So the
  accountant's epsilon after any round is a function of stored values and the round index,
  never of the round's view, and it is within the reservation by construction.
- The ledger *reserves* the whole epsilon_train (and its delta) at the first round and
  charges 0 to later rounds, which are bounded by the step budget R x tau instead. The
  per-round increments of the RDP epsilon depend on q, i.e. on |D|, so stating them would
  tell the server the record count; the reservation is data-independent and never
  under-counts (a run stopped after round 1 is charged the whole phase).
- The reservation is bound to what the noise was calibrated for and to everything that selects
  the data or sets the sampling (epsilon, delta, R, tau, B, model, finetune mode, LoRA rank,
  vocabulary, columns, table schema, max-length): a later round, or a resume, under other terms
  is refused with a fixed text before the records are read, so re-sending the run key with a
  larger epsilon, more rounds or another code's view cannot train past the charge or on data
  the first round did not sample from.
- Public checks before the reservation: the incoming weights (finite, within ``WEIGHT_LIMIT``,
  the model's own keys and shapes) and that the accountant can reach epsilon_train at all in
  R x tau steps (checked at q = 1, the worst any view can give). A per-record gradient that is
  not finite is replaced by zeros before clipping (``fedsyn_client.training``), so nothing
  non-finite reaches the noise.
- A round on an empty or small view releases like any other: DP-SGD with Poisson sampling is
  defined on an empty batch (the update is noise), and the noisy sum is divided by B.
- q, the noise multiplier and the accountant's epsilon go to the node's ledger only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord

from common import records as R
from common.accounting import rdp_noise
from common.calibration import Base, Planned, release_base
from common.config import ConfigError, RunConfig
from common.data import TextData
from common.devices import hidden_gpu_warning, model_device
from common.dp import DPSGD, TRAIN, poisson_sample_rate
from common.logs import get_logger
from fedsyn_client.refusals import BadWeights
from fedsyn_client.release import Mechanism, Output, Request, no_finite_noise

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

log = get_logger(__name__)
_TOL = 1e-6
# No trained weight of a language model comes near this; a value beyond it is an attack or a bug.
WEIGHT_LIMIT = 1e4


class DpSgdRound(Mechanism):
    """tau DP-SGD steps on the node's records from the global weights in ``arrays``."""

    name = DPSGD

    def __init__(self, cfg: RunConfig, records: Callable[[], TextData], arrays: ArrayRecord, state: dict[str, Any],
                 node_id: int, phase_reserved: bool = False, bound: int | None = None) -> None:
        # ``records`` is called only after the reservation: nothing before it reads a record.
        # ``bound``: the node's public size bound (policy max-records): q = B / bound, and each step
        # does the work of a Poisson sample of that many slots at the public width. None (a simulated
        # node: no institution, the partition is the server's choice): the view's own size, as fast as it goes
        self.cfg, self.records, self.arrays, self.node_id, self.bound = cfg, records, arrays, node_id, bound
        self.state = state  # this run's accountant state from the ledger ({} before round 1)
        self.total_steps = cfg.num_server_rounds * cfg.local_steps
        # The ledger already holds this run's phase-1 reservation. Usually from round 1; also when
        # the node was killed during a round: that reservation stays counted, and its steps stay
        # taken, so the node can rejoin later rounds without paying the phase again. The bound
        # holds either way, because the noise multiplier is calibrated for all R x tau steps and
        # the ledger never lets the run take more.
        self.phase_reserved = phase_reserved
        self.model: torch.nn.Module | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.base: Base = ()  # under pld: the ledger's earlier releases the phase's noise is solved on
        self._view: TextData | None = None
        self._fixed: tuple[float, float, float] | None = None

    def binding(self, request: Request) -> dict[str, Any]:  # noqa: D102 - documented on Mechanism
        cfg = self.cfg
        return {"epsilon": float(request.phase_budget), "delta": float(request.delta), "rounds": cfg.num_server_rounds,
                "local_steps": cfg.local_steps, "batch_size": cfg.batch_size, "model": cfg.model,
                "finetune": cfg.finetune, "lora_rank": cfg.lora_rank if cfg.finetune == "lora" else 0,
                "lora_layers": cfg.lora_layers if cfg.finetune == "lora" else 0,
                # what selects the data the first round sampled from, and how each record is read
                "vocabulary": sorted(request.vocabulary), "text_column": cfg.text_column,
                "control_columns": list(cfg.control_columns), "table_schema": cfg.table_schema,
                "max_length": cfg.max_length, **request.rule.binding()}

    def calibrate(self, request: Request, before: list[dict[str, Any]]) -> None:
        """Under pld, the phase's noise multiplier is solved (at the first round, on the node: it
        depends on q) so that every earlier release of the node (other runs' too) and all R x tau
        steps compose at the policy's delta to the earlier ones' epsilon plus epsilon_train; later
        rounds keep the first round's base."""
        stored = self.state.get("pld_base")
        self.base = (tuple(tuple(b) for b in stored) if stored is not None
                     else release_base([e for e in before if not (e["run_id"] == request.run_id
                                                                  and e["phase"] == request.phase)]))
        public_q = self.bound or self.state.get("sample_rate") or self.state.get("history")
        if request.rule.composes_ledger and self.cfg.private and public_q:
            # where q needs no record (a deployed node's bound, a later round's stored q), a phase no
            # finite noise spends is refused here, before the reservation, as a Gaussian release is
            _, nm, _ = self._fixed_terms(request, self.bound or 0)
            if math.isinf(nm):
                raise no_finite_noise(request, request.phase_budget)

    def terms(self, request: Request, reserved: bool) -> dict[str, Any]:
        """Under pld, the phase's noise multiplier and q, which the ledger composes it by: before
        the reservation where q needs no record (a deployed node's public bound, or a later round's
        stored q), after it on a simulated node (q from its partition, the server's choice)."""
        if not (request.rule.composes_ledger and self.cfg.private):
            return {}
        if self.bound or self.state.get("sample_rate") or self.state.get("history"):
            size = self.bound or 0  # q is the bound's, or the first round's stored: no record is read
        elif reserved:
            size = len(self._records())
        else:
            return {}
        q, nm, _ = self._fixed_terms(request, size)
        return {"noise_multiplier": nm, "sample_rate": q}

    def _records(self) -> TextData:
        """The node's records for this round, read once (only after the reservation)."""
        if self._view is None:
            self._view = self.records()
        return self._view

    def check(self, request: Request) -> None:
        """Public checks, before the reservation: epsilon_train reachable in R x tau steps at any
        q, and the incoming weights finite, bounded, and this model's keys and shapes."""
        from common.models import load_generator
        from common.weights import load_trainable_state, prepare_model

        if self.cfg.private and not self.state:
            try:  # q = 1 needs the most noise: if it can be calibrated there, any view's q can
                rdp_noise(request.phase_budget, request.delta, 1.0, self.total_steps)
            except ValueError as err:
                raise ConfigError(f"train: epsilon_train = {request.phase_budget:g} at delta = {request.delta:g} "
                                  "cannot "
                                  f"be reached in {self.total_steps} DP-SGD steps ({err}); raise epsilon or lower "
                                  "num-server-rounds x local-steps") from None

        try:
            state = R.state_from_arrays(self.arrays)
        except Exception as err:  # noqa: BLE001 - any unreadable record is bad weights
            raise BadWeights(f"train: the weights cannot be read: {type(err).__name__}: {err}") from None
        for name, arr in state.items():
            if not np.issubdtype(arr.dtype, np.floating):
                raise BadWeights(f"train: weight {name} has dtype {arr.dtype}, not a float")
            if not np.isfinite(arr).all():
                raise BadWeights(f"train: weight {name} has non-finite values")
            if arr.size and float(np.abs(arr).max()) > WEIGHT_LIMIT:
                raise BadWeights(f"train: weight {name} has |w| up to {float(np.abs(arr).max()):.3g} "
                                 f"> {WEIGHT_LIMIT:g}")
        model, self.tokenizer = load_generator(self.cfg.model, seed=self.cfg.seed)
        self.model = prepare_model(model, self.cfg.finetune, self.cfg.lora_rank, seed=self.cfg.seed,
                                   lora_layers=self.cfg.lora_layers)
        try:
            load_trainable_state(self.model, state)
        except ValueError as err:
            raise BadWeights(f"train: {err}") from None

    def cost(self, request: Request) -> tuple[float, float]:  # noqa: D102 - documented on Mechanism
        if not self.cfg.private:
            return math.inf, request.delta
        return (0.0, 0.0) if self.phase_reserved else (request.phase_budget, request.delta)

    def public(self, request: Request) -> dict[str, Any]:  # noqa: D102 - documented on Mechanism
        return {"steps": self.cfg.local_steps, "max_grad_norm": self.cfg.max_grad_norm,
                "covers": f"phase 1: {self.cfg.num_server_rounds} rounds x {self.cfg.local_steps} steps",
                **request.rule.terms(request.policy_delta)}

    def steps(self, request: Request) -> tuple[int, int]:  # noqa: D102 - documented on Mechanism
        return self.cfg.local_steps, self.total_steps

    def release(self, request: Request) -> Output:  # noqa: D102 - documented on Mechanism
        from fedsyn_client.training import TrainSettings, dp_train

        cfg = self.cfg
        history = [list(h) for h in self.state.get("history", [])]
        records = self._records()
        bound = self.bound or len(records)
        q, nm, delta = self._fixed_terms(request, bound)
        pld = request.rule.composes_ledger
        if cfg.private:
            # A function of stored values and the round index only (q and nm are the first round's,
            # the steps are bounded by the ledger): within the reservation by construction. A
            # failure here is a bug, never a fact about the view.
            after = request.rule.dpsgd_epsilon(history + [[nm, q, cfg.local_steps]], delta, self.base)
            if after > request.phase_budget + _TOL:
                raise RuntimeError(f"train: this round would take phase 1 to epsilon = {after:.4g}, above the "
                                   f"reserved {request.phase_budget:g}")
        warning = hidden_gpu_warning()
        if warning:
            log.warning("%s", warning)
        if self.model is None:
            self.check(request)
        model, tokenizer = self.model, self.tokenizer
        assert model is not None and tokenizer is not None  # loaded by check()
        log.info("round %d: DP-SGD on %s", request.round, model_device(model))
        settings = TrainSettings(
            local_steps=cfg.local_steps, batch_size=cfg.batch_size, learning_rate=cfg.learning_rate,
            max_length=cfg.max_length, max_grad_norm=cfg.max_grad_norm, noise_multiplier=nm, precision=cfg.precision,
            private=cfg.private, seed=cfg.seed * 100_003 + request.round * 101 + int(self.node_id % 100_000),
            sample_rate=q, prompt=cfg.prompt, template=cfg.zero_shot_template,
            # the objective does not widen a release: each record's gradient is clipped to C whatever it is
            contrastive_weight=cfg.contrastive_weight, vocabulary=tuple(sorted(request.vocabulary)),
            records_bound=self.bound,  # dp_train refuses a view above it (a fault, never a wider q)
        )
        result = dp_train(model, tokenizer, records.texts, records.codes, settings, delta, history)
        # The local loss is an un-noised statistic of the records: it stays in this log. The epsilon is
        # the ledger's (issue 75): under pld the phase's growth of the node's composition at the policy's
        # delta; Opacus' own RDP figure (at the same delta, the phase alone) is a looser bound beside it
        spent = after if cfg.private else math.inf
        log.info("round %d: %d DP-SGD steps, local loss %.4f, phase-1 epsilon so far %.4g of %.4g at delta %.3g "
                 "(the ledger's; Opacus' RDP bound says %.4g)", request.round, result.steps, result.mean_loss, spent,
                 request.phase_budget, delta, result.epsilon)
        private = {"noise_multiplier": nm, "sample_rate": q, "steps": result.steps,
                   "epsilon_accountant": result.epsilon if cfg.private else math.inf,
                   **({"epsilon_pld": after} if pld and cfg.private else {})}
        state = {"history": result.accountant_history, "mechanism": "rdp", "noise_multiplier": nm, "delta": delta,
                 "sample_rate": q, **({"pld_base": [list(b) for b in self.base]} if pld else {})}
        return Output(result.state, private=private, accountant=(accountant_key(request.run_id), state))

    def _fixed_terms(self, request: Request, num_records: int) -> tuple[float, float, float]:
        """(q, noise multiplier, delta): the first round's, stored with the accountant, for every
        round. The delta is the phase's under basic, the policy's under pld (what it composes at)."""
        if self._fixed is None:
            self._fixed = self._solve_terms(request, num_records)
        return self._fixed

    def _solve_terms(self, request: Request, num_records: int) -> tuple[float, float, float]:
        stored = self.state
        history = stored.get("history") or []
        if stored.get("sample_rate"):
            q = float(stored["sample_rate"])
        elif history:  # ledgers written before q was stored keep it in the history's first entry
            q = float(history[0][1])
        else:  # the first round: from the public bound (a deployed node's max-records)
            q = poisson_sample_rate(self.cfg.batch_size, num_records)
        delta = float(stored.get("delta", request.rule.composed_at(request.delta, request.policy_delta)))
        if not self.cfg.private:
            return q, 0.0, delta
        nm = stored.get("noise_multiplier") or request.rule.dpsgd_noise(
            self.base, Planned(TRAIN, DPSGD, request.phase_budget, delta, sample_rate=q, steps=self.total_steps), delta)
        return q, float(nm), delta


def accountant_key(run_id: str) -> str:
    """The ledger key of a run's DP-SGD accountant state."""
    return f"run-{run_id}"
