"""``fedsyn audit --canaries m``: the whole pipeline audited in one run, by canaries (issue 63).

The mechanism audit (``fedsyn_client.privacy_audit``) runs each Gaussian release thousands of times;
DP-SGD and the pipeline as a whole cannot be run so often. So, as in Steinke, Nasr & Jagielski (2023):

1. write m canary records the Canary's Echo way (ICML 2025: a membership signal that survives into a
   synthetic set needs a canary the model would not write by itself): an in-distribution prefix (the
   opening words of one of the dataset's records) and a high-perplexity suffix (words of the dataset
   drawn at random, in random order), under that record's code;
2. flip a fair coin for each; the canaries that come up "in" are added to the run's dataset, which the
   simulated sites are partitioned from (a record of any site is one the run must protect);
3. run the pipeline once, with the real ``flwr run`` (SuperLink, ServerApp, ClientApps);
4. score every canary by what was released: the synthetic set (how many of its suffix's word pairs the
   synthetic texts hold: a suffix is random, so only a memorised canary puts its pairs there) and, when
   the run finetuned, the released model (how much less its loss on the canary is than the pretrained
   model's: the membership test of the DP model);
5. guess "in" for the top k and "out" for the bottom k of each score and bound epsilon from the number
   of right guesses (``common.auditing.canary_guess``), against the largest epsilon any node's ledger
   states for the run.

A bound at or below the stated epsilon proves nothing (at a few hundred canaries it cannot exceed
about 4 even with every guess right); one above it proves a leak somewhere on the pipeline's path.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.auditing import CanaryGuess, canary_guess
from common.config import RunConfig
from common.logs import get_logger

log = get_logger(__name__)

DEFAULT_CANARIES = 400
PREFIX_WORDS, SUFFIX_WORDS = 12, 10
_WORD = re.compile(r"[A-Za-z]{3,}")


@dataclass(frozen=True)
class Canary:
    """One canary: its text (prefix + suffix), code, and the suffix whose memorisation is tested."""

    text: str
    code: str
    suffix: str


def make_canaries(texts: list[str], codes: list[str], m: int, rng: np.random.Generator) -> list[Canary]:
    """``m`` canaries from a dataset's ``texts`` and ``codes``: each the first ``PREFIX_WORDS`` words of
    a record drawn at random, then ``SUFFIX_WORDS`` words drawn uniformly from the dataset's words (3+
    letters), under the record's code."""
    if not texts or len(texts) != len(codes):
        raise ValueError("the canaries need the dataset's texts and codes (equal, non-empty lists)")
    words = sorted({w.lower() for t in texts for w in _WORD.findall(t)})
    if len(words) < SUFFIX_WORDS:
        raise ValueError(f"the dataset has {len(words)} distinct words; a canary's suffix needs {SUFFIX_WORDS}")
    out = []
    for _ in range(m):
        i = int(rng.integers(len(texts)))
        prefix = " ".join(texts[i].split()[:PREFIX_WORDS])
        suffix = " ".join(words[int(j)] for j in rng.integers(len(words), size=SUFFIX_WORDS))
        out.append(Canary(f"{prefix} {suffix}", codes[i], suffix))
    return out


def _pairs(text: str) -> set[tuple[str, str]]:
    words = [w.lower() for w in _WORD.findall(text)]
    return set(zip(words, words[1:]))


def synthetic_scores(canaries: list[Canary], synthetic: list[str]) -> np.ndarray:
    """Per canary, the share of its suffix's word pairs found anywhere in the ``synthetic`` texts."""
    seen: set[tuple[str, str]] = set()
    for text in synthetic:
        seen |= _pairs(text)
    return np.array([len(_pairs(c.suffix) & seen) / max(1, len(_pairs(c.suffix))) for c in canaries])


def model_scores(cfg: RunConfig, run_dir: Path, canaries: list[Canary], batch: int = 16) -> np.ndarray | None:
    """Per canary, the pretrained model's mean token loss on it minus the released model's (the run's
    code prompt, as it trained): larger where the run learnt the canary. None when the run released no
    finetuned model."""
    import torch

    from common.codes import make_prompt
    from common.lm_loss import encode_examples, sequence_nll
    from fedsyn_server.generate_more import released_arrays
    from fedsyn_server.synthesis import ServerModel

    arrays = released_arrays(run_dir)
    if arrays is None:
        return None
    server = ServerModel(cfg)

    def prompt(code: str) -> str:
        return make_prompt(code, cfg.prompt, cfg.zero_shot_template)

    def losses() -> np.ndarray:
        out = []
        with torch.no_grad():
            for i in range(0, len(canaries), batch):
                part = canaries[i:i + batch]
                enc = encode_examples(server.tokenizer, [c.text for c in part], [c.code for c in part],
                                      cfg.max_length, prompt)
                device = next(server.model.parameters()).device
                logits = server.model(input_ids=enc["input_ids"].to(device),
                                      attention_mask=enc["attention_mask"].to(device)).logits
                out.append(sequence_nll(logits, enc["labels"].to(device))[0].cpu().numpy())
        return np.concatenate(out)

    before = losses()
    server.load(arrays)
    return before - losses()


@dataclass
class CanaryAudit:
    """What the canary run found: per signal its guesses and bound, the run's stated epsilon."""

    canaries: int
    included: int
    stated_epsilon: float  # the largest any node's ledger states for the run (PLD at its delta)
    delta: float
    guesses: dict[str, CanaryGuess] = field(default_factory=dict)
    run_dir: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> list[str]:
        """The signals whose bound exceeds the stated epsilon."""
        return [name for name, g in self.guesses.items() if g.epsilon_lower > self.stated_epsilon]


def run_canary_audit(m: int = DEFAULT_CANARIES, overrides: dict[str, Any] | None = None, seed: int = 0,
                     confidence: float = 0.95, out_dir: Path | None = None, timeout: float = 3600) -> CanaryAudit:
    """Steps 1-5 of the module on the run of ``overrides`` (run-config keys; a text run). Raises
    ``ValueError`` for a table run or a dataset too small, ``RuntimeError`` when the run fails."""
    import time

    import pandas as pd

    from common.codes import parse_code
    from common.data import to_text_data
    from common.tables import load_table
    from fedsyn_server.flwr_runner import run_app

    start = time.perf_counter()
    cfg = RunConfig.from_flower({**RunConfig().to_flower(), **(overrides or {})})
    if cfg.schema() is not None:
        raise ValueError("the canary audit runs text runs (a canary is a text); audit a table's releases with "
                         "fedsyn audit --node-config")
    folder = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="fedsyn-canaries-"))
    folder.mkdir(parents=True, exist_ok=True)
    frame = load_table(cfg.dataset, text_columns=(cfg.text_column, *cfg.control_columns))
    data = to_text_data(frame, cfg.text_column, cfg.control_columns)
    rng = np.random.default_rng(seed)
    canaries = make_canaries(list(data.texts), list(data.codes), m, rng)
    included = rng.random(m) < 0.5
    rows = frame[[cfg.text_column, *cfg.control_columns]].astype(str)
    added = pd.DataFrame([{cfg.text_column: c.text, **parse_code(c.code)}
                          for c, inc in zip(canaries, included) if inc], columns=rows.columns)
    dataset = folder / "dataset-with-canaries.csv"
    pd.concat([rows, added], ignore_index=True).to_csv(dataset, index=False)
    (folder / "canaries.json").write_text(json.dumps([{"text": c.text, "code": c.code, "included": bool(inc)}
                                                      for c, inc in zip(canaries, included)]))
    res = run_app({**(overrides or {}), "dataset": str(dataset), "out-dir": str(folder / "runs"),
                   "run-name": "canaries"}, timeout=timeout)
    if not res.ok or res.run_dir is None:
        raise RuntimeError(f"the canary run failed (flwr run exit {res.returncode}): {res.output[-2000:]}")
    report = json.loads((res.run_dir / "privacy_report.json").read_text())
    # the run's statement for a record: the largest epsilon any node's ledger composes this run to, at its delta
    worst = max(report["nodes"], key=lambda n: float(n["epsilon_pld"]), default=None)
    if worst is None:
        raise RuntimeError(f"the canary run's privacy report names no node ({res.run_dir})")
    stated, delta = float(worst["epsilon_pld"]), float(worst["composed_delta"] or worst["delta"])
    synthetic = [json.loads(line)["text"] for line in (res.run_dir / "synthetic.jsonl").read_text().splitlines()
                 if line.strip()]
    k = max(1, m // 10)
    audit = CanaryAudit(m, int(included.sum()), stated, delta, run_dir=str(res.run_dir))
    audit.guesses["synthetic set"] = canary_guess(synthetic_scores(canaries, synthetic), included, k, delta,
                                                  confidence)
    scores = model_scores(cfg, res.run_dir, canaries)
    if scores is not None:
        audit.guesses["DP model"] = canary_guess(scores, included, k, delta, confidence)
    audit.seconds = time.perf_counter() - start
    return audit


def format_canary_audit(audit: CanaryAudit) -> str:
    """The canary audit as a table: per signal, guesses, right ones, the bound, against the statement."""
    lines = [f"fedsyn audit --canaries {audit.canaries}: {audit.included} canaries in the run's data, one run "
             f"({audit.run_dir}), {audit.seconds:.0f} s",
             "", f"{'signal':16} {'stated eps':>10} {'lower bound':>11} {'confidence':>10} {'guesses':>8} "
                 f"{'right':>6}  verdict"]
    for name, g in audit.guesses.items():
        lines.append(f"{name:16} {audit.stated_epsilon:10.4g} {g.epsilon_lower:11.4g} {g.confidence:10.4g} "
                     f"{g.guesses:8d} {g.correct:6d}  {'FAILS' if name in audit.failed else 'ok'}")
    return "\n".join(lines)


def cli(m: int, overrides: dict[str, Any] | None, seed: int, confidence: float) -> int:
    """``fedsyn audit --canaries m``: run, print the table; exit 1 naming a signal whose bound exceeds
    the run's stated epsilon."""
    import sys

    audit = run_canary_audit(m, overrides, seed, confidence)
    print(format_canary_audit(audit))
    if audit.failed:
        print(f"fedsyn audit: FAILED: the {', '.join(audit.failed)} prove(s) more than the run states",
              file=sys.stderr)
        return 1
    return 0
