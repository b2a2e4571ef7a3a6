"""``fedsyn generate <run-dir> -n N``: more texts from a finished run's released DP model.

The model a run released (its final trainable weights, in the run's checkpoint) and its noisy
profile are DP outputs already; generating from them is post-processing, so no node is asked
and no budget is spent, and the run's privacy report holds for the new texts unchanged. What
the new texts do not get is the run's refinement: the DP votes judged the run's pool only, so
these texts are like ``refinement = "none"`` on the same model (say so to whoever uses them).

What the votes did choose carries over: each code's texts are written by the pretrained weights
θ⁰ and the released ones in the shares the run's final set kept of each writer (``writers`` in
``profile.json``, ``strategies.writers``), and every row says its ``writer``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from common.config import RunConfig
from common.io import atomic_write_json, atomic_write_jsonl, read_json
from common.logs import get_logger
from fedsyn_server.outputs import text_row
from strategies.allocation import allocate_exactly
from strategies.refinement import FINETUNED, PRETRAINED
from strategies.writers import generate_pool, pretrained_counts

log = get_logger(__name__)
MORE = "more"  # <run-dir>/more/<name>.jsonl


def run_config_of(run_dir: Path) -> RunConfig:
    """The validated run config a run wrote (``config.json``); ValueError naming the fix."""
    path = run_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{run_dir} is not a finished fedsyn run (no config.json); give a run folder such as "
                         "outputs/latest")
    return RunConfig.from_flower(read_json(path))


def run_allocation(run_dir: Path, n: int) -> dict[str, int]:
    """N texts allocated as the run allocated its pool: the run's noisy global profile scaled to N,
    rounded so that they are exactly N (the run's own pool uses the paper's per-code rounding)."""
    profile = read_json(run_dir / "profile.json")
    counts = allocate_exactly(np.asarray(profile["global_profile"], dtype=np.float64), n)
    return {code: int(c) for code, c in zip(profile["vocabulary"], counts)}


def parse_allocation(spec: str, vocabulary: list[str]) -> dict[str, int]:
    """``"topic=sport:10,topic=tech:5"`` as {code: count}; ValueError naming a bad part."""
    out: dict[str, int] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        code, sep, count = part.rpartition(":")
        if not sep or code not in vocabulary:
            raise ValueError(f"--allocation part {part!r}: write CODE:COUNT with CODE one of {vocabulary}")
        if not count.isdigit():
            raise ValueError(f"--allocation part {part!r}: the count must be a whole number >= 0")
        out[code] = int(count)
    if not sum(out.values()):
        raise ValueError("--allocation asks for no text; give at least one CODE:COUNT with COUNT >= 1")
    return out


def run_writers(profile: dict[str, Any], counts: dict[str, int]) -> tuple[dict[str, int], str | None]:
    """Per code, how many of ``counts`` θ⁰ writes, and the tag of the released weights' texts
    (None: the run had one writer, θ⁰). From the share of each writer the run's final set kept
    per code (a code the run kept none of: the run's pool share); a run written before writers
    existed: its coverage-floor codes by θ⁰, the rest by the released weights."""
    writers = profile.get("writers")
    if not writers:
        return pretrained_counts(counts, 0.0, profile.get("pretrained_codes", [])), FINETUNED
    kept = writers.get("kept_share", {})
    tuned = sorted({w for s in kept.values() for w, v in s.items() if w != PRETRAINED and v > 0}
                   | {w for s in writers.get("pool", {}).values() for w in s if w != PRETRAINED})
    if not tuned:
        return dict.fromkeys(counts, 0), None
    share = float(writers.get("pretrained_share", 0.0))
    return ({c: pretrained_counts({c: n}, kept[c].get(PRETRAINED, 0.0) if c in kept else share)[c]
             for c, n in counts.items()}, tuned[-1])


def released_arrays(run_dir: Path) -> Any:
    """The run's released trainable weights (None: the run generated with the pretrained model)."""
    from strategies.checkpoint import load_checkpoint
    from strategies.result import FedSynResult

    return load_checkpoint(run_dir, FedSynResult).arrays


def generate_more(run_dir: str | Path, n: int | None = None, allocation: str | None = None, seed: int | None = None,
                  out: str | Path | None = None) -> Path:
    """Generate ``n`` texts (by the run's allocation) or the counts ``allocation`` gives, from the
    run's released model; write them as ``synthetic.jsonl`` rows to ``out`` (default
    ``<run-dir>/more/<time>-n<N>.jsonl``) with ``<out stem>.privacy.json`` beside. Returns ``out``."""
    from fedsyn_server.synthesis import ServerModel

    run_dir = Path(run_dir).expanduser().resolve()
    cfg = run_config_of(run_dir)
    profile = read_json(run_dir / "profile.json")
    vocabulary = profile["vocabulary"]
    if allocation:
        counts = parse_allocation(allocation, vocabulary)
    elif n is not None and n >= 1:
        counts = run_allocation(run_dir, n)
    else:
        raise ValueError("-n must be a whole number >= 1 (or give --allocation)")
    seed = int(np.random.SeedSequence().entropy % 2**31) if seed is None else seed  # type: ignore[operator]  # a fresh SeedSequence draws an int
    total = sum(counts.values())
    target = Path(out) if out else run_dir / MORE / f"{time.strftime('%Y%m%d-%H%M%S')}-n{total}.jsonl"
    model = ServerModel(cfg)
    base_counts, tuned_writer = run_writers(profile, counts)
    pool = generate_pool(model, counts, base_counts, model.weights(), released_arrays(run_dir), seed,
                         finetuned=tuned_writer is not None, tuned_writer=tuned_writer or PRETRAINED)
    texts, codes, report = pool.texts, pool.codes, pool.report
    atomic_write_jsonl(target, [{**text_row(t, c), "writer": w} for t, c, w in zip(texts, codes, pool.writers)])
    atomic_write_json(target.with_suffix(".privacy.json"), {
        "derived_from": str(run_dir), "epsilon_spent": 0.0, "nodes_asked": 0, "seed": seed, "allocation": counts,
        "generation": report,
        "note": ("post-processing of the run's released DP model and noisy profile: the run's privacy report "
                 "(below) covers these texts, and nothing more was spent. They were not refined by the run's "
                 "DP votes (those judged the run's pool only)."),
        "run_privacy_report": read_json(run_dir / "privacy_report.json"),
    })
    log.info("%d texts from the model of %s -> %s (no node asked, no budget spent)", len(texts), run_dir, target)
    return target
