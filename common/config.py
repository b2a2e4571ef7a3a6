"""The typed run configuration: every knob of ``[tool.flwr.app.config]``, validated once.

``RunConfig.from_flower(context.run_config)`` is called by the ServerApp before anything
is sent to a node and by every node on each message; an invalid value raises
``ConfigError`` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from common.accounting import DEFAULT as DEFAULT_ACCOUNTING, RULES as ACCOUNTING_RULES
from common.dp import BudgetSplit, paper_delta, phase_epsilon, split_budget
from common.plugins import AGGREGATORS, FINETUNE_MODES, REFINEMENTS, is_class_path

if TYPE_CHECKING:
    from common.rows import Schema

# code: the paper's bare code; instruction: phase 1 trains on the zero-shot template filled with the
# code, and generation uses it; zero-shot: the pretrained model with that template (no phase 1)
PROMPTS = ("code", "instruction", "zero-shot")
VOTERS = ("weak", "all")
# How a node composes its releases (issue 47): one object per rule, ``common.accounting.RULES``:
# "pld" (the default) spends the budget by a privacy-loss distribution (the same epsilon, less
# noise); "basic" adds epsilons, the paper's rule, for an institution that requires it.
ACCOUNTING = ACCOUNTING_RULES  # the live registry: a rule registered later is allowed too
ON_NODE_SHORTFALL = ("refuse", "continue-without")
PRECISIONS = ("auto", "fp32")
POPRI_LOSSES = ("dpo", "ipo")  # strategies.popri.LOSS_TYPES
POPRI_HISTOGRAMS = ("similarity", "centred-similarity")  # common.histograms
WRITER_CHOICES = ("better", "mix")  # strategies.writers.better_writer
# How a table run makes its rows (issue 48): "rows", the language model writes each row as text
# (issue 25); "marginals", every site releases noisy marginals and the server samples rows from a
# graphical model fitted to their sum (strategies.marginals); "auto", marginals for a table run
# (they beat both the rows and AIM on one site: docs/results.md#tables) and nothing for a text run
TABLE_METHODS = ("auto", "rows", "marginals")


class ConfigError(ValueError):
    """An invalid run-config value; the message names key, value and what is allowed."""


@dataclass(frozen=True)
class RunConfig:
    """All run-config keys (kebab-case in TOML, snake_case here) with their defaults."""

    num_server_rounds: int = 2
    local_steps: int = 3
    batch_size: int = 32
    learning_rate: float = 5e-3
    server_learning_rate: float = 1.0
    aggregator: str = "fedavg"
    max_length: int = 64
    model: str = "smollm2-135m"
    finetune: str = "lora"
    lora_rank: int = 2
    lora_layers: int = 0  # LoRA on the top N transformer blocks only (0 = every block)
    max_grad_norm: float = 1.0
    # > 0: phase 1 also reads each record under one other code and adds the pair term
    # (common.lm_loss.pair_objective, weighted); 0: the paper's eq. 5 loss alone
    contrastive_weight: float = 0.0
    precision: str = "auto"  # auto: bf16 autocast where the device computes bf16 natively; fp32: never
    dataset: str = "bbc-news"
    table_schema: str = ""  # a table run: the public schema as inline JSON ("" = a text column; see _schema)
    # TABLE_METHODS: "auto" (marginals with a table-schema), "rows" (the LLM writes rows), "marginals"
    table_method: str = "auto"
    marginal_bins: int = 16  # marginals: a number or date column is cut into this many equal bins of its declared range
    # marginals: measurement rounds; 1 measured better on Breast Cancer than 2 (docs/results.md#tables)
    marginal_rounds: int = 1
    # marginals with a free-text column: the share of each site's epsilon its marginals take; the
    # text's phases (DP finetuning, votes) take the rest
    marginal_share: float = 0.5
    text_column: str = "text"
    control_columns: tuple[str, ...] = ("topic",)
    control_codes: tuple[str, ...] = ()
    strong_fraction: float = 0.5
    partitioning: str = "iid"
    test_fraction: float = 0.1
    epsilon: float = 8.0
    epsilon_profile: float = 2.0
    delta: str = "1e-5"
    embedder: str = "all-MiniLM-L6-v2"
    eval_embedder: str = "all-MiniLM-L6-v2"  # the server's metrics: fixed, so methods with other vote embedders compare
    num_synthetic: int = 240  # the pool: each of the two writers 120 (pretrained-share 0.5)
    max_new_tokens: int = 0  # 0 = from the data: max-length minus the code prompt (what phase 1 trained)
    generation_batch_size: int = 0  # 0 = auto: from free memory, at most 128 on CPU, 512 on CUDA
    sampling_rate: float = 0.25  # keeps 60 of 240
    num_votes: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    guidance: float = 1.0  # classifier-free guidance scale at generation; 1 = off (fedsyn_server.generation)
    # codes the strong nodes hold less than this share of (relative to the data) are written by the
    # pretrained weights (strategies.coverage); 0 = off, every code from the finetuned model
    coverage_floor: float = 0.0
    # the share of each code's pool written by the pretrained weights with the zero-shot instruction,
    # the rest by the finetuned ones; the votes choose between them (strategies.writers). 0 = the paper
    pretrained_share: float = 0.5
    # "mix": A.4 over the whole pool of both writers; "better": each code's final texts from the writer its
    # votes rate higher. mix is the default: measured better on BBC both splits and movie-review-source IID
    writer_choice: str = "mix"
    prompt: str = "instruction"
    zero_shot_template: str = "Please generate a news article about {fields}:\n\n"
    refinement: str = "contrastive-vote"  # the paper's is "knn-vote"; chosen by measurement (docs/results.md)
    refinement_rounds: int = 2  # pe, popri, grpo: vote rounds T (epsilon_vote split evenly)
    popri_samples_per_prompt: int = 10  # POPri's J
    popri_rejected_rank: int = 5  # POPri's l
    popri_learning_rate: float = 1e-4
    popri_beta: float = 0.1  # DPO's beta (the paper's tau): how far from the round's reference
    popri_loss: str = "dpo"  # POPRI_LOSSES: dpo (the paper's) or ipo (its ablation)
    popri_epochs: int = 2  # DPO epochs over a round's pairs (the paper's 2); 0: no update (the paired control)
    popri_holdout: float = 0.25  # share of a round's pairs held out to judge its adapter (0: keep every round's)
    popri_histogram: str = "similarity"  # POPRI_HISTOGRAMS: the paper's scores, or centred (issue 74)
    grpo_group_size: int = 8  # GRPO's G: texts per prompt, normalised against each other
    grpo_learning_rate: float = 1e-4
    grpo_iterations: int = 2  # optimisation passes per batch of rollouts (> 1: PPO's ratio clip acts); 0: no update
    grpo_kl: float = 0.01  # the KL penalty's beta, against the weights the refinement starts from
    grpo_advantage_clip: float = 5.0  # |advantage| at most this (Concordia's)
    grpo_groups: int = 0  # groups of rollouts a training round; 0: the pool's (num-synthetic / G)
    voters: str = "all"  # VOTERS; "all" chosen by issue 46's grid (docs/results.md), "weak" is the paper's
    accounting: str = DEFAULT_ACCOUNTING  # simulated nodes' rule (a deployed node's is its node-config accounting)
    # simulated sites' trust (issue 73): each counts on this many sites, itself included, adds 1/sqrt(t) of
    # each Gaussian release's noise as Skellam noise, and masks it under secure aggregation; 1: trusts nobody
    min_honest_nodes: int = 1
    min_nodes: int = 0
    node_timeout: float = 3600.0
    on_node_shortfall: str = "refuse"  # a node that cannot finish the run: refuse to start, or go on without it
    out_dir: str = "outputs"
    run_name: str = ""
    resume: str = ""  # a run directory: continue that run from its checkpoint
    seed: int = 0
    plan_only: bool = False  # stage 0 alone (`fedsyn plan` on a deployment): the free tier query, then stop

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_flower(cls, run_config: Mapping[str, Any]) -> RunConfig:
        """Build and validate from Flower's run config (kebab-case keys, TOML types).

        Unknown keys are rejected (a typo would otherwise silently use a default).
        """
        known = {f.name.replace("_", "-"): f for f in fields(cls)}
        unknown = sorted(set(run_config) - set(known))
        if unknown:
            raise ConfigError(f"unknown run-config key(s) {unknown}; allowed keys: {sorted(known)}")
        values: dict[str, Any] = {}
        for key, raw in run_config.items():
            f = known[key]
            values[f.name] = _coerce(key, raw, f.type)
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def to_flower(self) -> dict[str, Any]:
        """The inverse of ``from_flower``: kebab-case keys, TOML-friendly values."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name.replace("_", "-")] = ",".join(v) if isinstance(v, tuple) else v
        return out

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise ``ConfigError`` for the first invalid value (key, value, what is allowed)."""
        checks: list[tuple[str, bool, str]] = [
            ("num-server-rounds", self.num_server_rounds >= 0, "an integer >= 0 (0 skips finetuning)"),
            ("local-steps", self.local_steps >= 1, "an integer >= 1"),
            ("batch-size", self.batch_size >= 1, "an integer >= 1"),
            ("learning-rate", 0 < self.learning_rate < 10, "a float in (0, 10)"),
            ("server-learning-rate", 0 < self.server_learning_rate <= 10, "a float in (0, 10]"),
            ("aggregator", self.aggregator in AGGREGATORS or is_class_path(self.aggregator),
             f"one of {list(AGGREGATORS)} or a class path 'package.module:Class'"),
            ("max-length", 8 <= self.max_length <= 8192, "an integer in [8, 8192]"),
            ("finetune", self.finetune in FINETUNE_MODES, f"one of {list(FINETUNE_MODES)}"),
            ("precision", self.precision in PRECISIONS, f"one of {list(PRECISIONS)}"),
            ("lora-rank", self.lora_rank >= 1, "an integer >= 1"),
            ("lora-layers", self.lora_layers >= 0, "an integer >= 0 (0 = every transformer block)"),
            ("max-grad-norm", self.max_grad_norm > 0, "a float > 0"),
            ("contrastive-weight", 0 <= self.contrastive_weight <= 100, "a float in [0, 100] (0 = the paper's loss)"),
            ("control-columns", len(self.control_columns) >= 1, "one or more comma-separated column names"),
            ("table-method", self.table_method in TABLE_METHODS, f"one of {list(TABLE_METHODS)}"),
            ("marginal-bins", 2 <= self.marginal_bins <= 1024, "an integer in [2, 1024]"),
            ("marginal-rounds", self.marginal_rounds in (1, 2), "1 (the 1-way marginals and the control column's "
             "pairs) or 2 (every pair first, then a tree of the strongest; strategies.graphical_model)"),
            ("marginal-share", 0.0 < self.marginal_share < 1.0, "a float in (0, 1): the share of epsilon a table "
             "with a free-text column gives its marginals (the text's phases take the rest)"),
            ("strong-fraction", 0.0 <= self.strong_fraction <= 1.0, "a float in [0, 1]"),
            ("test-fraction", 0.0 <= self.test_fraction < 0.9, "a float in [0, 0.9)"),
            ("epsilon", self.epsilon > 0, "a float > 0, or inf for no DP"),
            ("epsilon-profile", math.isinf(self.epsilon) or 0 < self.epsilon_profile < self.epsilon,
             f"a float in (0, epsilon={self.epsilon})"),
            ("num-synthetic", self.num_synthetic >= 1, "an integer >= 1"),
            ("max-new-tokens", 0 <= self.max_new_tokens <= 4096, "an integer in [0, 4096] (0 = from max-length)"),
            ("generation-batch-size", self.generation_batch_size >= 0, "an integer >= 0 (0 = auto from free memory)"),
            ("sampling-rate", 0 < self.sampling_rate <= 1, "a float in (0, 1]"),
            ("num-votes", self.num_votes >= 1, "an integer >= 1"),
            ("temperature", 0 <= self.temperature <= 5, "a float in [0, 5] (0 = greedy)"),
            ("top-p", 0 < self.top_p <= 1, "a float in (0, 1] (1 = plain sampling)"),
            ("guidance", 1 <= self.guidance <= 10, "a float in [1, 10] (1 = off)"),
            ("coverage-floor", 0 <= self.coverage_floor <= 1, "a float in [0, 1] (0 = off)"),
            ("pretrained-share", 0 <= self.pretrained_share <= 1,
             "a float in [0, 1]: the share of each code's pool the pretrained model writes (0 = every text "
             "from the finetuned model, the paper)"),
            ("writer-choice", self.writer_choice in WRITER_CHOICES, f"one of {list(WRITER_CHOICES)}"),
            ("prompt", self.prompt in PROMPTS, f"one of {list(PROMPTS)}"),
            ("zero-shot-template", "{fields}" in self.zero_shot_template, "a string containing {fields}"),
            ("refinement", self.refinement in REFINEMENTS or is_class_path(self.refinement),
             f"one of {list(REFINEMENTS)} or a class path 'package.module:Class'"),
            ("refinement-rounds", self.refinement_rounds >= 1, "an integer >= 1"),
            ("popri-samples-per-prompt", self.popri_samples_per_prompt >= 2, "an integer >= 2"),
            ("popri-rejected-rank", 2 <= self.popri_rejected_rank <= self.popri_samples_per_prompt,
             f"an integer in [2, popri-samples-per-prompt={self.popri_samples_per_prompt}]"),
            ("popri-learning-rate", 0 < self.popri_learning_rate < 1, "a float in (0, 1)"),
            ("popri-beta", 0 < self.popri_beta <= 100, "a float in (0, 100]"),
            ("popri-loss", self.popri_loss in POPRI_LOSSES, f"one of {list(POPRI_LOSSES)}"),
            ("popri-epochs", 0 <= self.popri_epochs <= 100, "an integer in [0, 100] (0: no DPO, the paired control)"),
            ("popri-holdout", 0 <= self.popri_holdout < 1, "a float in [0, 1) (0: keep every round's adapter)"),
            ("popri-histogram", self.popri_histogram in POPRI_HISTOGRAMS, f"one of {list(POPRI_HISTOGRAMS)}"),
            ("grpo-group-size", self.grpo_group_size >= 2, "an integer >= 2"),
            ("grpo-learning-rate", 0 < self.grpo_learning_rate < 1, "a float in (0, 1)"),
            ("grpo-iterations", 0 <= self.grpo_iterations <= 16,
             "an integer in [0, 16] (0: no update, the paired control)"),
            ("grpo-kl", 0 <= self.grpo_kl <= 10, "a float in [0, 10] (0: no KL term)"),
            ("grpo-advantage-clip", self.grpo_advantage_clip > 0, "a float > 0"),
            ("grpo-groups", self.grpo_groups >= 0, "an integer >= 0 (0: as many as the pool's num-synthetic / G)"),
            ("voters", self.voters in VOTERS, f"one of {list(VOTERS)}"),
            ("accounting", self.accounting in ACCOUNTING, f"one of {list(ACCOUNTING)}"),
            ("min-honest-nodes", self.min_honest_nodes >= 1, "an integer >= 1 (1: every site adds the whole noise)"),
            ("min-nodes", self.min_nodes >= 0, "an integer >= 0 (0 = wait until the node count is stable)"),
            ("node-timeout", self.node_timeout > 0, "seconds > 0"),
            ("on-node-shortfall", self.on_node_shortfall in ON_NODE_SHORTFALL, f"one of {list(ON_NODE_SHORTFALL)}"),
            ("out-dir", bool(self.out_dir.strip()), "a non-empty path"),
            ("run-name", "/" not in self.run_name and ".." not in self.run_name, "a folder name without '/' or '..'"),
        ]
        for key, ok, allowed in checks:
            if not ok:
                raise ConfigError(_message(key, getattr(self, key.replace("-", "_")), allowed))
        schema = self.schema()  # raises ConfigError for an unusable schema
        if schema is not None:
            from common.codes import CODE_FIELD_SEP, CODE_KV_SEP

            for name in self.control_columns:
                if name not in schema.names or schema.column(name).type != "categorical":
                    raise ConfigError(_message("control-columns", ",".join(self.control_columns),
                                               "categorical columns of table-schema "
                                               f"({[c.name for c in schema.columns if c.type == 'categorical']})"))
                if any(CODE_FIELD_SEP in v or CODE_KV_SEP in v for v in schema.column(name).categories):
                    raise ConfigError(f"invalid run config: table-schema: the categories of control column {name!r} "
                                      f"may not contain '{CODE_FIELD_SEP}' or '{CODE_KV_SEP}' "
                                      "(they are written into codes)")
            if len(self.control_columns) == len(schema.structured().columns) and not self.marginals:
                raise ConfigError(_message("control-columns", ",".join(self.control_columns),
                                           "fewer columns than table-schema has: the others are what is generated"))
            if schema.text_column is not None and not self.marginals:
                raise ConfigError(_message("table-method", self.table_method,
                                           "'marginals' for a table with a free-text "
                                           f"column ({schema.text_column!r}): the sites measure the other columns' "
                                           "marginals and the language model writes the text from each sampled row"))
            if self.marginals:
                _check_measurable(schema.structured(), self.marginal_bins)
        elif self.marginals:
            raise ConfigError(_message("table-method", self.table_method,
                                       "'auto' (the default) for a text run: 'marginals' needs a "
                                       "table-schema (the public columns whose marginals the sites count)"))
        try:
            self.resolve_delta(num_records=2)
        except ValueError:
            raise ConfigError(_message("delta", self.delta, "a float in (0, 1) or 'paper' (1/(2N log N))")) from None
        from common.partitioning import parse_partitioning  # deferred: it pulls in pandas

        try:
            parse_partitioning(self.partitioning)
        except ValueError as err:
            raise ConfigError(_message("partitioning", self.partitioning, str(err))) from None

    # ----------------------------------------------------------------- derived
    def schema(self) -> Schema | None:
        """The table's public schema (``table-schema``), or None for a text run."""
        return _schema(self.table_schema) if self.table_schema.strip() else None

    @property
    def private(self) -> bool:
        """False when ``epsilon = inf``: every mechanism is switched off."""
        return not math.isinf(self.epsilon)

    def budget(self) -> BudgetSplit:
        """The per-node epsilon split of appendix B (profile + train-or-vote)."""
        return split_budget(self.epsilon, self.epsilon_profile)

    @property
    def marginals(self) -> bool:
        """Whether this is a table run by federated marginals: ``table-method = "marginals"``, or
        ``"auto"`` (the default) with a ``table-schema``. Public config only, so node and server agree."""
        return self.table_method == "marginals" or (self.table_method == "auto" and bool(self.table_schema.strip()))

    @property
    def free_text(self) -> str | None:
        """A marginals run's free-text column (the language model writes it), or None."""
        schema = self.schema()
        return schema.text_column if self.marginals and schema is not None else None

    @property
    def writes_text(self) -> bool:
        """Whether a language model writes anything in this run: every run but a table by
        marginals alone (one with a free-text column writes that column)."""
        return not self.marginals or self.free_text is not None

    @property
    def marginals_share(self) -> float:
        """The share of a node's epsilon for the marginals phase: 1 for a table by marginals alone,
        ``marginal-share`` for one with a free-text column, 0 for every other run."""
        if not self.marginals:
            return 0.0
        return self.marginal_share if self.free_text is not None else 1.0

    def phase_epsilon(self, tier: str, phase: str) -> float:
        """A node of ``tier``'s epsilon for ``phase`` in this run (``common.dp.phase_epsilon``)."""
        return phase_epsilon(self.epsilon, self.epsilon_profile, tier, self.voters, phase,
                             marginals=self.marginals_share)

    @property
    def trains(self) -> bool:
        """Whether the run has phase 1 (DP finetuning on the strong nodes): a marginals run only
        for its free-text column."""
        return self.prompt != "zero-shot" and self.num_server_rounds > 0 and self.writes_text

    @property
    def vote_window(self) -> int:
        """Tokens of each text the vote embeds, records and candidates alike: 2 x max-length.

        A candidate is at most max-length generator tokens, which the embedder's finer WordPiece
        tokens need more of; a record contributes its opening of about the same span. Measured on
        BBC News (``benchmarks/vote_window.py``, 2 runs x 20 noise draws, paired): at 1 x
        max-length topic accuracy fell by 0.017, at 2 x by 0.005 (within noise), against whole
        texts; the vote's embedding is 2x faster than whole 256-token articles."""
        return 2 * self.max_length

    def resolve_delta(self, num_records: int) -> float:
        """Per-release delta: the configured float, or the paper's 1/(2N log N) for 'paper'.

        The paper's N is a number of *records*; pass a public one (the run dataset's
        training split). Every node still caps delta by its own policy.
        """
        if str(self.delta).strip().lower() == "paper":
            return paper_delta(num_records)
        value = float(self.delta)
        if not 0 < value < 1:
            raise ValueError(f"delta must be in (0, 1), got {value}")
        return value


@lru_cache(maxsize=8)
def _schema(value: str) -> Schema:
    from common.rows import SchemaError, load_schema

    # Inline only: every node reads the run config, and a deployed node must never open a path
    # the server chose. `fedsyn run` and `fedsyn plan` put a schema file's JSON here for you.
    if not value.strip().startswith("{"):
        raise ConfigError(f"invalid run config: table-schema = {value[:80]!r}; allowed: inline JSON "
                          '{"columns": [...]}; `fedsyn run` and `fedsyn plan` read a schema file into it for you')
    try:
        return load_schema(value)
    except SchemaError as err:
        raise ConfigError(f"invalid run config: table-schema: {err}") from None


def _check_measurable(schema: Schema, bins: int) -> None:
    """Every column of a marginals run has a finite domain from the schema alone (a number or date
    column its declared range), before anything is sent: ``ConfigError`` naming the column."""
    from common.marginals import domain_size

    for column in schema.columns:
        try:
            domain_size(column, bins)
        except ValueError as err:
            raise ConfigError(f"invalid run config: table-method = 'marginals' (the default for a table): {err}; "
                              "or ask the language model to write the rows with table-method = 'rows'") from None


def _message(key: str, value: Any, allowed: str) -> str:
    return f"invalid run config: {key} = {value!r}; allowed: {allowed}"


def _coerce(key: str, raw: Any, typ: Any) -> Any:
    """Convert a TOML value to the field's type, with an error naming the key."""
    conv: dict[str, Callable[[Any], Any]] = {
        "int": _to_int, "float": _to_float, "str": str, "tuple[str, ...]": _to_tuple, "bool": _to_bool,
    }
    try:
        return conv[str(typ)](raw)
    except (TypeError, ValueError):
        raise ConfigError(_message(key, raw, f"a value of type {typ}")) from None


def _to_int(raw: Any) -> int:
    if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
        raise ValueError(raw)
    return int(raw)


def _to_float(raw: Any) -> float:
    if isinstance(raw, bool):
        raise ValueError(raw)
    return float(raw)  # float("inf") accepts "inf" as well as TOML's inf


def _to_bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if str(raw).lower() in ("true", "false"):
        return str(raw).lower() == "true"
    raise ValueError(raw)


def _to_tuple(raw: Any) -> tuple[str, ...]:
    items = raw if isinstance(raw, (list, tuple)) else str(raw).split(",")
    return tuple(s.strip() for s in items if str(s).strip())


def parse_pairs(values: list[str], flag: str) -> dict[str, Any]:
    """``key=value`` pairs (``--run-config``, ``--node-config``, ...) parsed as Flower parses them.

    Flower's parser answers a string value without double quotes (``tier=weak``) with a click
    exception and a long traceback; here it is one ``ConfigError`` naming the pairs to quote.
    """
    from click import ClickException
    from flwr.common.config import parse_config_args

    try:
        return dict(parse_config_args(values))
    except (ClickException, ValueError):
        bare = [tok.split("=", 1) for v in values for tok in v.split()
                if "=" in tok and not _toml_scalar(tok.split("=", 1)[1])]
        quoted = [f'{k}="{v}"' for k, v in bare]
        hint = (f"quote string values ({', '.join(quoted)}) and the whole argument in single quotes, e.g. "
                f"{flag} '{' '.join(quoted)}'" if bare else "values must be bool, int, float or a double-quoted string")
        raise ConfigError(f"{flag} {' '.join(values)!r} cannot be read: {hint}") from None


def _toml_scalar(text: str) -> bool:
    import tomllib

    try:
        tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return False
    return True
