"""The fedsyn ServerApp: validate, set up, run the strategy, write the outputs."""

from __future__ import annotations

import time
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from common.logs import get_logger
from common.config import ConfigError, RunConfig
from common.data import DatasetFileError, DatasetLoadError
from common.federation import Benchmark, benchmark
from common.io import atomic_write_json, atomic_write_jsonl
from fedsyn_server.experiment import EVALUATION_FILE
from fedsyn_server.outputs import save_model, write_outputs
from fedsyn_server.synthesis import ServerModel
from strategies.aggregators import build_aggregator
from strategies.fedsyn import FedSynResult, FedSynStrategy, RunRefused
from strategies.refinement import build_refinement

log = get_logger("fedsyn")
APP_ROOT = Path(__file__).resolve().parent.parent
app = ServerApp()


def run_directory(cfg: RunConfig, run_id: int) -> Path:
    """``<out-dir>/<run-name>`` as an absolute path; a relative out-dir is under the app root.

    The ServerApp's working directory is not the app's, so a relative path is resolved
    against the app root explicitly. The default run name is time + run id: unique.
    """
    out = Path(cfg.out_dir).expanduser()
    if not out.is_absolute():
        out = APP_ROOT / out
    name = cfg.run_name or time.strftime("%Y%m%d-%H%M%S") + f"-{run_id}"
    return (out / name).resolve()


def build_strategy(cfg: RunConfig) -> tuple[FedSynStrategy, Benchmark, ServerModel]:
    """Everything the server needs for a run: the strategy, the public data, the model.

    Raises (before any message is sent) on a bad aggregator or refinement name.
    """
    build_aggregator(cfg.aggregator, cfg.server_learning_rate, 1)  # fail early on a bad class path
    refinement = build_refinement(cfg.refinement)
    bench = benchmark(cfg)
    server_model = ServerModel(cfg)
    strategy = FedSynStrategy(
        cfg, bench.vocabulary,
        make_aggregator=lambda n: build_aggregator(cfg.aggregator, cfg.server_learning_rate, n),
        refinement=refinement, generator=server_model,
        # 'paper' delta: N = the run dataset's training records (public); nodes cap delta themselves
        delta=cfg.resolve_delta(len(bench.train)),
        evaluate_fn=lambda rnd, arrays: server_model.heldout_loss(arrays, bench.test),
    )
    return strategy, bench, server_model


def evaluate_run(run_dir: Path, cfg: RunConfig, result: FedSynResult, bench: Benchmark) -> None:
    """Score the final synthetic set against the held-out split (utility, alignment,
    allocation) and write ``evaluation.json``; an evaluation error never loses the run."""
    from fedsyn_server.evaluation import evaluate_sets, format_report, mauve_available

    final = [int(i) for i in result.selected]
    try:
        scores = evaluate_sets([result.pool_texts[i] for i in final], [result.pool_codes[i] for i in final],
                               bench.test.texts, bench.test.codes, list(cfg.control_columns),
                               embedder=cfg.embedder, seed=cfg.seed, mauve=mauve_available())
    except Exception as err:  # noqa: BLE001 - the synthetic set is written already
        log.error("evaluation against the held-out split failed: %s", err)
        return
    atomic_write_json(run_dir / EVALUATION_FILE, scores)
    log.info("evaluation against %d held-out records:\n%s", len(bench.test), format_report(scores))


class RunFailed(RuntimeError):
    """The run stopped on an input error or a refusal; the message is the whole story (one line)."""


# Errors whose message already names the key or file, the value and the fix: the operator
# needs that line, not a traceback through Flower. Anything else keeps its traceback (a bug).
INPUT_ERRORS = (ConfigError, RunRefused, FileNotFoundError, DatasetLoadError, DatasetFileError)


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
    run_dir = run_directory(cfg, context.run_id)
    log.info("fedsyn run %s: outputs go to %s", context.run_id, run_dir)
    strategy, bench, server_model = build_strategy(cfg)
    result = strategy.run(grid, server_model.initial_arrays())
    paths = write_outputs(run_dir, cfg, bench.vocabulary, result)
    if result.arrays is not None and (result.train_metrics or result.generator_refined):
        save_model(server_model.load(result.arrays), run_dir)
    if len(bench.test):  # public benchmark records no node trained on, for `fedsyn evaluate`
        atomic_write_jsonl(run_dir / "heldout.jsonl", bench.test.to_records())
        evaluate_run(run_dir, cfg, result, bench)
    log.info("fedsyn run %s finished in %.0fs: %d synthetic texts in %s", context.run_id,
             result.timings.get("total", 0.0), len(result.selected), paths["synthetic"])
    if result.degradations:  # said last, so an operator reading the tail of the log sees it
        log.warning("run %s finished DEGRADED (%d, also in metrics.json): %s", context.run_id,
                    len(result.degradations), "; ".join(result.degradations))
