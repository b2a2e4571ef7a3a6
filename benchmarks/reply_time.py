"""Can a server tell a node's record count from its replies' ClientApp time? (issue 45)

Usage: python -m benchmarks.reply_time [--replies 24] [--bound 2000] [--sizes 100 2000]
       [--kinds profile vote train] [--model smollm2-135m] [--max-length 64] [--out benchmarks/reply_time.json]

Flower's SuperNode times each message from the ClientApp pulling it to the ClientApp pushing the
reply (``supernode/servicer/runtime/runtime_handlers.py``) and sends that time to the SuperLink with
the reply. This times the same span of the real ClientApp (``fedsyn_client.client_app.app``, called
through Flower's ``ClientApp``, in a process forked for the reply) on a deployed node holding the first
``size`` BBC News articles
under one ``max-records`` bound: a profile, a contrastive vote over 60 candidates, a DP-SGD round
(the run's defaults). Each reply runs in a fresh process on a fresh ledger, as a SuperNode's
ClientApp does; it loads the models before the clock starts (their loading is the same public work
for any data, and leaving it out makes the test stricter). The sizes take turns, reply by reply, so a
drift of the machine falls on both.

``padded``: the node as it is. ``unpadded``: the same code with the bound taken away (the node of
before issue 45: it reads its file on every request, embeds and tokenizes its records as they are,
and samples at q = B / |D|). For each, the two sizes' replies are compared with a two-sample KS
test and their medians against the run-to-run spread (the larger interquartile range). Each
reply's peak resident memory (Linux's VmHWM, reset before the clock starts) is kept beside its time.

Writes ``--out`` (JSON: every time) and a plot beside it (``.png``); prints the table for
``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from common import records as R
from common.config import RunConfig
from common.data import load_table
from common.io import atomic_write_json

KINDS = ("profile", "vote", "train")
VARIANTS = ("padded", "unpadded")
TIERS = {"profile": "weak", "vote": "weak", "train": "strong"}
PEAKS: dict[tuple[str, str, int], list[float]] = {}  # peak resident MiB per reply, as ``measure``'s times
MESSAGES = {"profile": R.MSG_PROFILE, "vote": R.MSG_VOTE, "train": R.MSG_TRAIN}


def write_nodes(folder: Path, sizes: list[int],
                candidates: int = 60) -> tuple[dict[int, str], list[str], list[str], list[str]]:
    """One CSV per size (the first ``size`` BBC News articles), the vocabulary and ``candidates``
    public candidate texts with their codes (articles after every node's)."""
    cfg = RunConfig()
    frame = load_table(cfg.dataset)
    column = cfg.control_columns[0]
    paths = {}
    for size in sizes:
        path = folder / f"node-{size}.csv"
        frame[[cfg.text_column, column]].iloc[:size].to_csv(path, index=False)
        paths[size] = str(path)
    vocabulary = sorted(f"{column}={v}" for v in frame[column].unique())
    tail = frame.iloc[max(sizes):max(sizes) + candidates]
    return paths, vocabulary, list(tail[cfg.text_column]), [f"{column}={v}" for v in tail[column]]


MAX_LENGTH = RunConfig().max_length  # --max-length: the tokens of a training row; a vote's window is twice it


def run_config(data: str, model: str) -> dict[str, Any]:
    """The run's defaults, with ``model``, ``MAX_LENGTH`` and the node's file (a deployed node reads its own)."""
    return RunConfig(dataset=data, model=model, test_fraction=0.0, max_length=MAX_LENGTH).to_flower()


def node_config(kind: str, data: str, state: Path, bound: int) -> dict[str, Any]:
    """A deployed node's policy: ``bound`` records, a budget no reply here can spend, votes at the run's window."""
    return {"tier": TIERS[kind], "data-path": data, "max-records": bound, "state-dir": str(state),
            "epsilon": 1e6, "control-columns": "topic", "vote-window": 2 * MAX_LENGTH}


def message(kind: str, vocabulary: list[str], texts: list[str], codes: list[str], arrays, cfg: RunConfig):
    """The request a server sends for ``kind`` (round 1 of a run)."""
    from flwr.app import ConfigRecord, Message, RecordDict

    conf: dict[str, Any] = {"codes": vocabulary, "delta": 1e-5, "resume-key": "bench", "server-round": 1}
    content = RecordDict()
    if kind == "vote":
        conf.update({"histogram": "contrastive-vote", "epsilon-share": 1.0, "num-votes": cfg.num_votes})
        content[R.CANDIDATES] = ConfigRecord({"texts": texts, "codes": codes})
    if kind == "train":
        content[R.ARRAYS] = arrays
    if kind == "profile":
        conf["server-round"] = 0
    content[R.CONFIG] = ConfigRecord(conf)
    return Message(content=content, message_type=MESSAGES[kind], dst_node_id=5)


def measure(kinds: list[str], sizes: list[int], bound: int, replies: int, model: str, variants: list[str],
            folder: Path) -> dict[str, dict[str, dict[int, list[float]]]]:
    """Seconds per reply: ``[kind][variant][size]``, each reply in a child forked from this process
    (``_forked``)."""
    from tests.neighbours import initial_arrays

    paths, vocabulary, texts, codes = write_nodes(folder, sizes)
    # The libraries are imported here, once: in a SuperNode's ClientApp their import falls inside the
    # reply's time (the app is loaded after the message is pulled), the same public work for any
    # data, and leaving it out makes the comparison stricter. No model is loaded here: a thread it
    # starts could hold a lock at a fork, and the child wait on it forever.
    import opacus  # noqa: F401
    import peft  # noqa: F401
    import sentence_transformers  # noqa: F401
    import transformers  # noqa: F401

    from fedsyn_client import client_app, train_release  # noqa: F401
    arrays = _forked(initial_arrays, run_config(paths[sizes[0]], model)) if "train" in kinds else None
    out: dict[str, dict[str, dict[int, list[float]]]] = {}
    for kind in kinds:
        for variant in variants:
            common = (kind, variant, bound, model, vocabulary, texts, codes, arrays)
            seeds = {}
            for size in sizes:  # node-check's work: the node's view, built once per node
                seeds[size] = folder / f"seed-{kind}-{variant}-{size}"
                _forked(_reply, paths[size], seeds[size], *common)
            times: dict[int, list[float]] = {size: [] for size in sizes}
            for i in range(replies):
                for size in sizes if i % 2 else reversed(sizes):  # take turns: a drift falls on both
                    state = folder / f"s-{kind}-{variant}-{size}-{i}"
                    shutil.copytree(seeds[size], state, ignore=shutil.ignore_patterns("ledger*", "*.lock"))
                    took, peak = _forked(_reply, paths[size], state, *common)
                    times[size].append(took)
                    PEAKS.setdefault((kind, variant, size), []).append(peak)
                    shutil.rmtree(state, ignore_errors=True)
                print(f"{kind} {variant} reply {i + 1}/{replies}: " + ", ".join(
                    f"|D|={s}: {times[s][-1]:.3f} s" for s in sizes), file=sys.stderr, flush=True)
            out.setdefault(kind, {})[variant] = times
    return out


def _forked(fn, *args):
    """``fn(*args)`` in a child forked from this process, as a SuperNode runs each message in a
    fresh ClientApp process: no allocator, cache or garbage state of an earlier reply (running
    them in one process, the memory the larger node's last reply left made the next one's reads
    slower). Returns its result; raises its error."""
    import multiprocessing
    import traceback

    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            send.send((True, fn(*args)))
        except BaseException:  # noqa: BLE001 - reported to the parent, which raises
            send.send((False, traceback.format_exc()))

    process = ctx.Process(target=child)
    process.start()
    send.close()
    ok, value = receive.recv()
    process.join()
    if not ok:
        raise RuntimeError(f"a reply failed in its child process:\n{value}")
    return value


def _reply(data: str, state: Path, kind: str, variant: str, bound: int, model: str, vocabulary: list[str],
           texts: list[str], codes: list[str], arrays) -> float:
    """Seconds the real ClientApp took to answer one ``kind`` request on the node (``variant``)."""
    from fedsyn_client import node as node_module
    from fedsyn_client.client_app import app
    from tests.fakes import client_node, set_task_identity

    if variant == "unpadded":  # the same code with the bound taken away
        deployed = node_module._deployed_policy
        node_module._deployed_policy = lambda c: dataclasses.replace(deployed(c), max_records=0)
    from common.models import load_embedder, load_generator

    set_task_identity()
    rc = run_config(data, model)
    # loaded before the clock: a SuperNode's ClientApp loads them in each message, the same public
    # work for any data; leaving it out makes the comparison stricter
    load_embedder(RunConfig.from_flower(rc).embedder)
    if kind == "train":
        load_generator(model)
    node = client_node(app, 5, node_config(kind, data, state, bound), rc, run_id=1)
    msg = message(kind, vocabulary, texts, codes, arrays, RunConfig.from_flower(rc))
    _reset_peak()
    t0 = time.perf_counter()
    reply = node(msg)
    took = time.perf_counter() - t0
    if reply.has_error():
        raise RuntimeError(f"{kind} on {data}: {reply.error.reason}")
    return took, _peak_mib()


def _reset_peak() -> None:
    # Linux: writing 5 to clear_refs resets the process's peak resident set (VmHWM) to its current size
    Path("/proc/self/clear_refs").write_text("5")


def _peak_mib() -> float:
    """The process's peak resident set since ``_reset_peak`` (MiB): the models, loaded before, included."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def compare(a: list[float], b: list[float]) -> dict[str, float | bool]:
    """KS p-value, medians, their difference and the spread (the larger interquartile range)."""
    from scipy.stats import ks_2samp

    iqr = max(float(np.subtract(*np.percentile(x, [75, 25]))) for x in (a, b))
    da, db = float(np.median(a)), float(np.median(b))
    p = float(ks_2samp(a, b).pvalue)
    return {"ks_p": p, "median_small": da, "median_large": db, "median_difference": db - da, "spread": iqr,
            "told_apart": bool(p <= 0.05 or abs(db - da) > iqr)}


def plot(times: dict, sizes: list[int], path: Path) -> None:
    """One panel per kind: each variant's and size's reply times as points over a box."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(times)
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 3.6), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        labels, data = [], []
        for variant in times[kind]:
            for size in sizes:
                labels.append(f"{variant}\n|D|={size}")
                data.append(times[kind][variant][size])
        ax.boxplot(data, showfliers=False)
        for j, ys in enumerate(data, start=1):
            ax.plot(np.full(len(ys), j) + np.random.default_rng(j).uniform(-0.12, 0.12, len(ys)), ys, ".", alpha=0.5)
        ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=8)
        ax.set_title(f"{kind} reply")
        ax.set_ylabel("ClientApp time (s)")
        ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    """Measure, compare, write ``--out`` and its plot, print the README table."""
    global MAX_LENGTH
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replies", type=int, default=24)
    ap.add_argument("--bound", type=int, default=2000)
    ap.add_argument("--sizes", type=int, nargs=2, default=[100, 2000])
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--model", default=RunConfig().model, help="the generator of the training replies")
    ap.add_argument("--max-length", type=int, default=MAX_LENGTH,
                    help="run-config max-length (a training row's tokens; the vote window is twice it)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/reply_time.json"))
    args = ap.parse_args(argv)
    if max(args.sizes) > args.bound:
        ap.error(f"--sizes {args.sizes} above --bound {args.bound}: a larger file is cut to the bound")
    MAX_LENGTH = args.max_length
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        times = measure(args.kinds, args.sizes, args.bound, args.replies, args.model, args.variants, Path(tmp))
    small, large = args.sizes
    verdicts = {k: {v: compare(times[k][v][small], times[k][v][large]) for v in times[k]} for k in times}
    result = {"bound": args.bound, "sizes": args.sizes, "replies": args.replies, "model": args.model,
              "max_length": args.max_length,
              "seconds": round(time.time() - started), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "verdicts": verdicts, "times": {k: {v: {str(s): t for s, t in d.items()} for v, d in vv.items()}
                                              for k, vv in times.items()}}
    atomic_write_json(args.out, result)
    plot(times, args.sizes, args.out.with_suffix(".png"))
    print(f"| reply | code | median |D|={small} | median |D|={large} | difference | spread (IQR) | KS p | told apart |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, by in verdicts.items():
        for variant, v in by.items():
            print(f"| {kind} | {variant} | {v['median_small']:.3f} s | {v['median_large']:.3f} s | "
                  f"{v['median_difference']:+.3f} s | {v['spread']:.3f} s | {v['ks_p']:.3g} | "
                  f"{'yes' if v['told_apart'] else 'no'} |")
    print(f"\n| reply | code | peak memory |D|={small} | peak memory |D|={large} (median, min-max MiB) |")
    print("|---|---|---|---|")
    for (kind, variant), _ in {(k, v): 0 for k, v, _ in PEAKS}.items():
        cells = [PEAKS[(kind, variant, size)] for size in args.sizes]
        print(f"| {kind} | {variant} | "
              + " | ".join(f"{np.median(c):.0f} ({min(c):.0f}-{max(c):.0f})" for c in cells) + " |")
    result["peak_mib"] = {f"{k} {v} {n}": p for (k, v, n), p in PEAKS.items()}
    atomic_write_json(args.out, result)
    for kind in times:
        if "unpadded" in times[kind] and "padded" in times[kind]:
            cost = np.median(times[kind]["padded"][small]) / np.median(times[kind]["unpadded"][small])
            print(f"padding costs a node of {small} records {cost:.2f}x on a {kind} reply")
    return 0


if __name__ == "__main__":
    sys.exit(main())
