"""The fedsyn ServerApp: validate, set up, run the strategy, write the outputs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from common.config import ConfigError, RunConfig
from common.data import TextData, free_text_part
from common.federation import Benchmark, benchmark
from common.io import atomic_symlink, atomic_write_jsonl, atomic_write_text
from common.logs import get_logger, plain_console
from common.tables import DatasetFileError, DatasetLoadError
from fedsyn_server.experiment import EVALUATION_FILE
from fedsyn_server.outputs import save_model, text_row, write_outputs
from fedsyn_server.synthesis import ServerModel
from strategies.aggregators import build_aggregator
from strategies.checkpoint import Checkpoint, load_checkpoint
from strategies.fedsyn import FedSynStrategy
from strategies.membership import NodesMissing, RunRefused
from strategies.refinement import build_refinement
from strategies.result import FedSynResult
from strategies.session import Orchestration, RoundUnanswered
from strategies.writers import writers_summary

log = get_logger("fedsyn")
RESUME_CONFIG = "resume.toml"
LATEST = "latest"  # <out-dir>/latest -> the newest run's folder
plain_console()  # no escape codes in streamed logs and log files
app = ServerApp()


def app_path(path: str) -> Path:
    """``path`` as an absolute path; a relative one is under the ServerApp's working directory.

    In simulation that is the directory the local SuperLink was started in, i.e. where the
    first ``flwr run`` ran, which is where the user is in the usual case; the ClientApps resolve
    a relative ``dataset`` against the same directory. ``fedsyn run`` makes every path absolute
    against the user's own directory before ``flwr run`` sees it. (The app's own folder is a
    copy under ``$FLWR_HOME/apps/`` whose name changes with every edit: never a place for outputs.)
    """
    out = Path(path).expanduser()
    return (out if out.is_absolute() else Path.cwd() / out).resolve()


def run_directory(cfg: RunConfig, run_id: int) -> Path:
    """``<out-dir>/<run-name>`` as an absolute path (the default run name, time + run id, is
    unique); for a resumed run, the run directory it continues."""
    if cfg.resume:
        return app_path(cfg.resume)
    return app_path(cfg.out_dir) / (cfg.run_name or time.strftime("%Y%m%d-%H%M%S") + f"-{run_id}")


# Keys a resumed run may change: where and how long to wait, not what is computed.
RESUME_MAY_CHANGE = ("resume", "node-timeout", "min-nodes", "on-node-shortfall", "out-dir", "run-name", "plan-only")


def check_resumable(checkpoint: Checkpoint, cfg: RunConfig, run_dir: Path) -> None:
    """Raise ``ConfigError`` when ``cfg`` differs from the checkpointed run's config in a key
    that changes what is computed (nodes read the run config too), naming keys and the fix."""
    now = cfg.to_flower()
    differs = sorted(k for k, v in checkpoint.progress.config.items()
                     if k not in RESUME_MAY_CHANGE and str(now.get(k)) != str(v))
    if differs:
        raise ConfigError(
            "resume: the run config differs from the run being resumed in " + ", ".join(
                f"{k} ({now.get(k)!r}, was {checkpoint.progress.config[k]!r})" for k in differs)
            + f"; resume with its config: flwr run . --run-config {run_dir / RESUME_CONFIG}")


def write_resume_config(cfg: RunConfig, run_dir: Path) -> Path:
    """``<run-dir>/resume.toml``: this run's config plus ``resume``, for ``--run-config``."""
    import tomli_w

    values = {k: v for k, v in cfg.to_flower().items() if k != "resume"}
    return atomic_write_text(run_dir / RESUME_CONFIG, tomli_w.dumps({**values, "resume": str(run_dir)}))


def build_strategy(cfg: RunConfig, load_model: bool = True) -> tuple[Orchestration, Benchmark, ServerModel | None]:
    """Everything the server needs for a run: the orchestration (``FedSynStrategy`` for a text run,
    ``MarginalsStrategy`` for a table by marginals, with a free-text column's text stages inside it;
    ``start`` runs either), the public data, the model (``load_model=False``: none, for stage 0
    alone; a marginals table run without a free-text column has none either).

    Raises (before any message is sent) on a bad aggregator or refinement name.
    """
    bench = benchmark(cfg)
    # 'paper' delta: N = the run dataset's training records (public); nodes cap delta themselves
    delta = cfg.resolve_delta(len(bench.train))
    if not cfg.writes_text:  # a table by marginals alone: no language model anywhere
        from strategies.marginals import MarginalsStrategy

        return MarginalsStrategy(cfg, bench.vocabulary, delta=delta), bench, None
    build_aggregator(cfg.aggregator, cfg.server_learning_rate, 1)  # fail early on a bad class path
    server_model = ServerModel(cfg) if load_model else None
    # a table's free-text column: the language model learns and writes that column alone
    heldout = free_text_part(bench.test) if cfg.free_text is not None else bench.test
    parts: dict[str, Any] = dict(
        make_aggregator=lambda n: build_aggregator(cfg.aggregator, cfg.server_learning_rate, n),
        refinement=build_refinement(cfg.refinement), generator=server_model,  # None only for plan-only
        delta=delta,
        evaluate_fn=(lambda rnd, arrays: server_model.heldout_loss(arrays, heldout)) if server_model else None)
    if cfg.marginals:  # a table by marginals with a free-text column (strategies.marginals)
        from strategies.marginals import MarginalsStrategy

        return MarginalsStrategy(cfg, bench.vocabulary, **parts), bench, server_model
    return FedSynStrategy(cfg, bench.vocabulary, **parts), bench, server_model


# How long the node count must stay unchanged before stage 0 asks (``Membership.discover``). In a
# simulation every SuperNode is registered before the ServerApp's first call (Flower's
# ``start_vce``), so the deployment's 3 s only delay the run there.
SIMULATION_STABLE_SECONDS = 0.5


def stable_seconds(grid: Grid) -> float:
    """The wait for a stable node count on ``grid``: short in a simulation, 3 s on a deployment."""
    return SIMULATION_STABLE_SECONDS if type(grid).__name__ == "InMemoryGrid" else 3.0


def plan_only(grid: Grid, cfg: RunConfig) -> None:
    """Run config ``plan-only``: stage 0 alone, then each answering node's tier, budget and the
    noise of each phase as ``plan:`` log lines, which ``fedsyn plan`` reads from the stream.
    No model is loaded, nothing is spent, nothing is written. Raises ``RunRefused`` (after its
    lines) when some node cannot finish the run."""
    from fedsyn_server.plan import deployment_lines

    strategy, _, _ = build_strategy(cfg, load_model=False)
    strategy.session.stable_seconds = stable_seconds(grid)
    refused: RunRefused | None = None
    try:
        strategy.preflight(grid)
    except RunRefused as err:
        refused = err
    session = strategy.session
    for line in deployment_lines(cfg, session.members.answered, session.result, session.delta):
        log.info("plan: %s", line)
    if refused is not None:
        raise refused
    log.info("plan: ok: every node that answered can finish this run; nothing was spent")


def evaluate_run(run_dir: Path, cfg: RunConfig, result: FedSynResult, bench: Benchmark) -> None:
    """Score the final synthetic set against the held-out split (utility, alignment,
    allocation) and write ``evaluation.json``; an evaluation error never loses the run."""
    from fedsyn_server.evaluation import evaluate_sets, format_report, mauve_available, write_evaluation

    assert result.selected is not None, "a finished run has its final set (stage 4, or M for a table, sets it)"
    final = [int(i) for i in result.selected]
    # a table's free-text column is scored as text: its label fidelity is how often a classifier
    # of the real texts reads each synthetic text as its own row's label
    syn = TextData([result.pool_texts[i] for i in final], [result.pool_codes[i] for i in final])
    syn, real = (free_text_part(syn), free_text_part(bench.test)) if cfg.free_text is not None else (syn, bench.test)
    try:
        scores = evaluate_sets(syn.texts, syn.codes, real.texts, real.codes, list(cfg.control_columns),
                               embedder=cfg.eval_embedder, seed=cfg.seed, mauve=mauve_available(),
                               cache_real=True)  # bench.test: public records, the same every run
    except Exception as err:  # noqa: BLE001 - the synthetic set is written already
        log.error("evaluation against the held-out split failed: %s", err)
        return
    schema = cfg.schema()
    if schema is not None:
        try:
            scores["table"] = table_scores(cfg, schema, [result.pool_texts[i] for i in final],
                                           [result.pool_codes[i] for i in final], bench)
        except Exception as err:  # noqa: BLE001 - as above
            log.error("the table evaluation failed: %s", err)
    scores["writers"] = writers_summary(result)  # per code, the share of the kept texts each writer wrote
    write_evaluation(run_dir / EVALUATION_FILE, scores)
    log.info("evaluation against %d held-out records:\n%s", len(bench.test), format_report(scores))


def table_scores(cfg: RunConfig, schema: Any, texts: list[str], codes: list[str], bench: Benchmark) -> dict[str, Any]:
    """A table run's final rows against the held-out rows (``evaluation.tables``): fidelity,
    dependence, efficacy of the first control column, and (the benchmark's training rows being
    public in a simulation) the distance to the closest training record."""
    from fedsyn_server.evaluation.tables import evaluate_table, records_frame

    return evaluate_table(records_frame(texts, codes, schema),
                          records_frame(bench.test.texts, bench.test.codes, schema), schema, cfg.control_columns[0],
                          real_train=records_frame(bench.train.texts, bench.train.codes, schema), seed=cfg.seed)


class RunFailed(RuntimeError):
    """The run stopped on an input error or a refusal; the message is the whole story (one line)."""


class RunSkipped(RunFailed):
    """The run wrote its outputs, but a phase it planned got no node at all: its status is failed."""


# Errors whose message already names the key or file, the value and the fix: the operator
# needs that line, not a traceback through Flower. Anything else keeps its traceback (a bug).
INPUT_ERRORS = (ConfigError, RunRefused, NodesMissing, RunSkipped, RoundUnanswered, FileNotFoundError,
                DatasetLoadError, DatasetFileError)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run fedsyn (Algorithm 1) over ``grid`` with the run config in ``context``.

    An input error or a refusal is logged as one line and ends the run as failed
    (``RunFailed``, raised without the chain so the log stays short).
    """
    try:
        _main(grid, context)
    except INPUT_ERRORS as err:
        line = f"{type(err).__name__}: {err}"
        log.error("fedsyn run %s failed: %s", context.run_id, line)
        raise RunFailed(line) from None


def _main(grid: Grid, context: Context) -> None:
    cfg = RunConfig.from_flower(context.run_config)  # before anything is sent to a node
    if cfg.plan_only:
        plan_only(grid, cfg)
        return
    run_dir = run_directory(cfg, context.run_id)
    checkpoint = load_checkpoint(run_dir, FedSynResult) if cfg.resume else None
    if checkpoint is not None:
        check_resumable(checkpoint, cfg, run_dir)
    log.info("fedsyn run %s: outputs go to %s%s", context.run_id, run_dir, " (resumed)" if checkpoint else "")
    if not Path(cfg.resume or cfg.out_dir).expanduser().is_absolute():
        log.info("(a relative path is under the SuperLink's working directory %s, where the first `flwr run` "
                 "started it; `fedsyn run` resolves paths against yours)", Path.cwd())
    strategy, bench, server_model = build_strategy(cfg)
    strategy.session.resume_key = str(context.run_id)  # a resumed run takes its original key from the checkpoint
    strategy.session.checkpoint_dir = run_dir
    strategy.session.stable_seconds = stable_seconds(grid)
    if checkpoint is None:
        write_resume_config(cfg, run_dir)
    atomic_symlink(run_dir.parent / LATEST, run_dir.name)
    try:
        result = strategy.start(grid, server_model.initial_arrays() if server_model else None, resume=checkpoint)
    except Exception:
        strategy.end_holds(grid)  # a run that broke off frees what its nodes hold for it (a resume holds again)
        raise
    paths = write_outputs(run_dir, cfg, bench.vocabulary, result)
    if server_model is not None and result.arrays is not None and (result.train_metrics or result.generator_refined):
        save_model(server_model.load(result.arrays), run_dir)
    if len(bench.test):  # public benchmark records no node trained on, for `fedsyn evaluate`
        atomic_write_jsonl(run_dir / "heldout.jsonl",
                           [text_row(t, c) for t, c in zip(bench.test.texts, bench.test.codes)])
        evaluate_run(run_dir, cfg, result, bench)
    assert result.selected is not None, "a finished run has its final set (stage 4, or M for a table, sets it)"
    log.info("fedsyn run %s finished in %.0fs: %d synthetic texts in %s", context.run_id,
             result.timings.get("total", 0.0), len(result.selected), paths["synthetic"])
    if result.degradations:  # said last, so an operator reading the tail of the log sees it
        log.warning("run %s finished DEGRADED (%d, also in metrics.json): %s", context.run_id,
                    len(result.degradations), "; ".join(result.degradations))
    if result.skipped:  # a planned phase that got no node at all is not a completed run
        raise RunSkipped(f"a planned phase got no node at all: {'; '.join(result.skipped)} (outputs in {run_dir}; "
                         "see metrics.json)")
