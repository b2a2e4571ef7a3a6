"""The server's model work: initial weights, generation and variation (the refinements' ``Generator``),
held-out loss."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord

from common import records as R
from common.codes import make_prompt, unconditional_prompt
from common.config import RunConfig
from common.data import TextData
from common.devices import to_device
from common.io import atomic_write_json
from common.logs import get_logger
from common.models import load_generator, public_cache_path
from common.rows import IS, SEP, Column, RowError, Schema, generated_part, parse, written_pairs
from common.weights import load_trainable_state, prepare_model, trainable_state, without_idle_adapter
from fedsyn_server.generation import generate_samples
from fedsyn_server.text_quality import first_line, trim_cut, unusable, unusable_row
from strategies.refinement import Generator

log = get_logger("fedsyn")
VALUE_TOKENS = 4  # a table value's token limit beyond its widest text (a space, an end, a spare)
VALUE_RETRIES = 3  # further draws of one table value that breaks the schema
REGENERATE = 2  # further attempts for a text that is unusable (then it is dropped and counted)
HELDOUT_EVAL_RECORDS = 64  # enough for a stable loss, ~5 s per round on CPU with SmolLM2


SPARE_SHARE = 0.02  # spare texts of a code, as a share of its allocation (at least one; ``spare_codes``)


def spare_codes(allocation: Mapping[str, int]) -> list[str]:
    """The codes of the spare texts written beside an allocation: ``SPARE_SHARE`` of each code's
    count, at least one per code that has any. An unusable text (1 to 3 of 120 at the defaults)
    was written again alone, a batch of its own that costs as much time as one of 120 on a CPU
    (about 4 s on 2 cores): a spare from the first batch now stands in for it, and only when a
    code's spares run out is the text asked again."""
    return [c for c, n in allocation.items() if n > 0 for _ in range(max(1, math.ceil(SPARE_SHARE * n)))]


def filled_from_spares(codes: list[str], texts: list[str | None], spares: list[str],
                       spare_texts: list[str | None]) -> tuple[list[str | None], int]:
    """(``texts`` with each None replaced by the next unused usable spare of its code where one
    is left, how many spares were used). In: the allocated texts' codes and texts (None =
    unusable), the spares' codes and texts. Spares are taken in order, so the result is a
    function of the inputs; unused spares are dropped (they are extra samples of the same
    prompts, so which text stands in changes no distribution)."""
    left: dict[str, list[str]] = {}
    for code, text in zip(spares, spare_texts):
        if text is not None:
            left.setdefault(code, []).append(text)
    out, used = list(texts), 0
    for i, (code, text) in enumerate(zip(codes, texts)):
        if text is None and left.get(code):
            out[i], used = left[code].pop(0), used + 1
    return out, used


def _leading_columns(text: str, schema: Schema) -> list[tuple[str, str]]:
    """The first half (rounded down) of a row's (column, value) pairs, in its written order;
    none when the text is not a row (a variation of it is then a fresh row)."""
    try:
        parse(text, schema)
    except RowError:
        return []
    pairs = written_pairs(text, schema)
    return pairs[: len(pairs) // 2]


class ValueRule:
    """The grammar of one column's value as the model writes it after ``<name> is``: a space,
    then the start of a value of the column (``Column.could_start``); it may end once whole."""

    def __init__(self, column: Column) -> None:
        self.column = column
        self.alphabet = frozenset(" ") | column.characters()

    def allows(self, text: str) -> bool:  # noqa: D102 - documented on generation.TextRule
        return text.startswith(" ") and self.column.could_start(text[1:])

    def done(self, text: str) -> bool:  # noqa: D102 - documented on generation.TextRule
        return text.startswith(" ") and self.column.complete(text[1:])


class ServerModel(Generator):
    """The global generator on the server: same base and adapter structure as the nodes'."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        model, self.tokenizer = load_generator(cfg.model, seed=cfg.seed)
        self.model = prepare_model(model, cfg.finetune, cfg.lora_rank, seed=cfg.seed, lora_layers=cfg.lora_layers)
        self._report: dict[str, Any] = {}
        self._frozen_digest: str | None = None  # of the weights phase 1 never changes (``_loss_key``)
        self._style = cfg.prompt  # the prompt style ``prompt`` writes with (``generate(prompt=...)`` sets it)
        schema = cfg.schema()
        # a table's rows by the language model (table-method "rows"); a marginals run's free-text
        # column is text like any text run's, its rows come from the graphical model
        self.row_schema = None if schema is None or cfg.marginals else generated_part(schema, cfg.control_columns)

    def initial_arrays(self) -> ArrayRecord:
        """theta^0: the trainable weights every strong node starts round 1 from."""
        return self.weights()

    def weights(self) -> ArrayRecord:
        """The current trainable weights (after phase 1, or after a refinement trained them)."""
        return R.arrays_from_state(trainable_state(self.model))

    def load(self, arrays: ArrayRecord | None) -> Any:
        """Set the global weights (None keeps the current ones) and return the model."""
        if arrays is not None:
            load_trainable_state(self.model, R.state_from_arrays(arrays))
        return self.model

    def generate(self, allocation: Mapping[str, int], seed: int,
                 prompt: str | None = None) -> tuple[list[str], list[str]]:
        """s_j samples for each code c_j, prompted by the code (paper eq. 3); (texts, codes).
        ``prompt``: the prompt style (run-config ``prompt`` values) to write with, the run's by
        default; the pretrained writer of a mixed pool writes with the instruction
        (``strategies.writers``).

        Only usable texts (``fedsyn_server.text_quality``): a text stopped by the token limit
        loses its cut last word; an empty, prompt-copy or looping one is asked again, up to
        ``REGENERATE`` times with other seeds, then dropped. ``generation_report`` counts both.
        """
        self._style = prompt or self.cfg.prompt
        try:
            with without_idle_adapter(self.model):  # theta^0's adapter adds zero: the same texts, sooner
                return self._generate(allocation, seed)
        finally:
            self._style = self.cfg.prompt

    def _generate(self, allocation: Mapping[str, int], seed: int) -> tuple[list[str], list[str]]:
        codes = [code for code, n in allocation.items() for _ in range(n)]
        log.info("[generate] %d texts for %d codes", len(codes), sum(n > 0 for n in allocation.values()))
        spares = spare_codes(allocation)
        prompts = [self.prompt(c) for c in codes + spares]
        unconditional = [self.unconditional_prompt(c) for c in codes + spares]  # guidance's other branch
        texts: list[str | None] = [None] * len(prompts)
        rejected: Counter[str]
        todo, rejected, used = list(range(len(prompts))), Counter(), 0
        limit = self.new_tokens(prompts)
        for attempt in range(1 + REGENERATE):
            if not todo:
                break
            if attempt:
                log.info("[generate] asking again for %d unusable texts (attempt %d)", len(todo), attempt + 1)
            again_seed = seed if not attempt else int(np.random.SeedSequence([seed, attempt]).generate_state(1)[0])
            if self.row_schema is None:
                samples = self._samples([prompts[i] for i in todo], limit, again_seed,
                                        unconditional=[unconditional[i] for i in todo])
            else:
                samples = self._rows([prompts[i] for i in todo], limit, again_seed)
            for i, (text, hit_limit) in zip(todo, samples):
                text = trim_cut(text, hit_limit)
                if self.row_schema is not None:  # a table: the text is one row, or it is asked again
                    text = first_line(text)
                    why = unusable_row(text, self.row_schema)
                else:
                    why = unusable(text, prompts[i])
                if why is None:
                    texts[i] = text
                else:
                    rejected[why] += 1
            if not attempt:  # a spare of the same code stands in for an unusable text; the rest are dropped
                texts[:len(codes)], used = filled_from_spares(codes, texts[:len(codes)], spares, texts[len(codes):])
                texts = texts[:len(codes)]
            todo = [i for i, t in enumerate(texts) if t is None]
        kept = [i for i, t in enumerate(texts) if t is not None]
        written = Counter(codes[i] for i in kept)
        self._report = {"requested": len(codes), "written": len(kept), "dropped": len(todo),
                        "rejected": dict(rejected), "attempts": 1 + REGENERATE,
                        "spares": {"written": len(spares), "used": used},
                        "per_code": {c: {"allocated": int(n), "written": written.get(c, 0)}
                                     for c, n in allocation.items()}}
        if todo:
            log.warning("[generate] dropped %d of %d texts still unusable after %d attempts (%s)", len(todo),
                        len(codes), 1 + REGENERATE, dict(rejected))
        return [texts[i] for i in kept], [codes[i] for i in kept]  # type: ignore[misc]  # kept: the written (not None) texts

    def generation_report(self) -> dict[str, Any]:  # noqa: D102 - documented on Generator
        return dict(self._report)

    def variation(self, texts: list[str], codes: list[str], seed: int) -> list[str]:
        """One variation of each text: keep its first half (by words, or by columns for a row)
        after the code prompt and let the model write the rest.

        A base LM cannot follow a "rephrase" instruction as Aug-PE's instruct models do, so the
        variation resamples the second half of the text, the sequence analogue of PE's
        partial re-noising of an image; the kept half ties the child to its parent. For a row
        this is Tab-PE's variation: some attributes kept, the others drawn again (under the
        columns' grammar, ``_rows``).
        """
        if self.row_schema is not None:
            kept = [_leading_columns(t, self.row_schema) for t in texts]
            drawn = self._rows([self.prompt(c) for c in codes], 0, seed, kept=kept)
            return [t for t, _ in drawn]
        heads = [" ".join(t.split()[: len(t.split()) // 2]) for t in texts]
        tails = self._samples([self.prompt(c) + h + (" " if h else "") for c, h in zip(codes, heads)],
                              max(1, self.new_tokens([self.prompt(c) for c in codes]) // 2), seed)
        return [f"{h} {trim_cut(t, hit)}".strip() for h, (t, hit) in zip(heads, tails)]

    def _rows(self, prompts: list[str], max_new_tokens: int, seed: int,
              kept: list[list[tuple[str, str]]] | None = None) -> list[tuple[str, bool]]:
        """A table run's texts: the server writes each column's name, the model only its value.

        A small DP-finetuned model does not learn the rigid ``name is value, ...`` form from a few
        noisy steps (SmolLM2 on Breast Cancer at the defaults: 0 of 360 free texts were rows,
        and with the names written for it most values were out of range or not numbers). So
        each record's columns are taken in an order drawn from ``seed`` (as in training); for
        each, the model continues ``<prompt><row so far>, <name> is`` under the column's grammar
        (``generation.GrammarConstraint``): its own distribution restricted to the column's
        values. Every position is one batched call over all rows. A value that still fails
        (the token limit, an impossible date) is drawn again alone, ``VALUE_RETRIES`` times at
        most; ``unusable_row`` then checks the row.

        ``kept`` (a variation): per prompt, (column, value) pairs written first, as they are;
        the model draws the other columns after them.
        """
        del max_new_tokens  # a value's own limit applies
        rng = np.random.default_rng(seed)
        assert self.row_schema is not None  # rows are written for a table run only
        columns = self.row_schema.columns
        kept = kept or [[] for _ in prompts]
        rows = [SEP.join(f"{n}{IS}{v}" for n, v in pairs) for pairs in kept]
        orders = []
        for pairs in kept:
            done = {n for n, _ in pairs}
            orders.append([j for j in rng.permutation(len(columns)) if columns[j].name not in done])
        limit = VALUE_TOKENS + max(c.widest() for c in columns)
        for k in range(max(map(len, orders), default=0)):
            live = [i for i in range(len(prompts)) if k < len(orders[i])]
            heads = {i: (rows[i] + SEP if rows[i] else "") + f"{columns[orders[i][k]].name}{IS.rstrip()}" for i in live}
            values = dict.fromkeys(live, "")
            todo = live
            for attempt in range(1 + VALUE_RETRIES):
                drawn = self._samples([prompts[i] + heads[i] for i in todo], limit,
                                      int(np.random.SeedSequence([seed, k, attempt]).generate_state(1)[0]),
                                      rules=[ValueRule(columns[orders[i][k]]) for i in todo])
                again = []
                for i, (v, _) in zip(todo, drawn):
                    values[i] = re.split(r"[,\n]", v, maxsplit=1)[0].strip()
                    if not columns[orders[i][k]].complete(values[i]):
                        again.append(i)
                todo = again
                if not todo:
                    break
            for i in live:
                rows[i] = f"{heads[i]} {values[i]}"
        return [(r, False) for r in rows]

    def _samples(self, prompts: list[str], max_new_tokens: int, seed: int, rules: list[ValueRule] | None = None,
                 unconditional: list[str] | None = None) -> list[tuple[str, bool]]:
        # Guidance (run-config `guidance`) where a text is written from its code alone; variations
        # continue a text's first half, and table values are constrained by their column instead.
        return generate_samples(self.model, self.tokenizer, prompts, max_new_tokens=max_new_tokens,
                                temperature=self.cfg.temperature, top_p=self.cfg.top_p, seed=seed,
                                batch_size=self.cfg.generation_batch_size, precision=self.cfg.precision,
                                rules=rules, guidance=self.cfg.guidance, unconditional=unconditional)

    def new_tokens(self, prompts: list[str]) -> int:
        """The token limit of a generated text: ``max-new-tokens``, or (0 = from the data) what
        phase 1 trained the model to write: ``max-length`` minus the longest of these prompts'
        tokens (records were cut there), ``max-length`` itself for zero-shot prompts."""
        if self.cfg.max_new_tokens:
            return self.cfg.max_new_tokens
        if self._style == "zero-shot" or not prompts:
            return self.cfg.max_length
        longest = max(len(self.tokenizer(p)["input_ids"]) for p in set(prompts))
        return max(1, self.cfg.max_length - longest)

    def unconditional_prompt(self, code: str) -> str:
        """The prompt of ``code`` with its values replaced (classifier-free guidance's other branch)."""
        return unconditional_prompt(code, self._style, self.cfg.zero_shot_template)

    def prompt(self, code: str) -> str:
        """The generation prompt for ``code``, the one phase 1 trained on (``common.codes.make_prompt``)."""
        return make_prompt(code, self._style, self.cfg.zero_shot_template)

    def heldout_loss(self, arrays: ArrayRecord, test: TextData) -> dict[str, float] | None:
        """Mean conditional LM loss (eq. 5) of the global model on held-out records.

        A diagnostic (it steers nothing): computed at the run's ``precision`` (bf16 autocast where
        the CPU or GPU has native bf16, as phase 1 trains) and, where the output layer is a plain
        ``hidden @ W^T`` (``common.lm_loss.head_and_decoder``), only at the label positions without
        the full-vocabulary logits: about half the time of fp32 full logits on 2 CPU cores."""
        from common.devices import autocast
        from common.lm_loss import conditional_lm_loss, encode_examples, fused_sequence_nll, head_and_decoder

        if len(test) == 0:
            return None
        sub = test.subset(range(min(HELDOUT_EVAL_RECORDS, len(test))))
        model = self.load(arrays)
        # public inputs alone (the weights, the held-out split, the settings): theta^0's loss is the
        # same in every run of a model and dataset, so it is kept across runs (5 s of the default run)
        path = public_cache_path("heldout-loss", self._loss_key(sub), ".json")
        try:
            return {"heldout_loss": float(json.loads(path.read_text())["heldout_loss"])}
        except (OSError, ValueError, KeyError, TypeError):
            pass
        tok = self.tokenizer
        old_side, tok.padding_side = tok.padding_side, "right"
        try:
            batch = encode_examples(tok, sub.texts, sub.codes, self.cfg.max_length, self.prompt)
        finally:
            tok.padding_side = old_side
        split = head_and_decoder(model)
        total = 0.0
        with torch.inference_mode(), autocast(model, self.cfg.precision):
            for i in range(0, len(sub), 16):
                part = to_device({k: v[i:i + 16] for k, v in batch.items()}, model)
                inputs = {"input_ids": part["input_ids"], "attention_mask": part["attention_mask"],
                          "position_ids": part["position_ids"], "use_cache": False}
                if split is not None:
                    decoder, head = split
                    nll = fused_sequence_nll(decoder(**inputs).last_hidden_state, head.weight, part["labels"])[0]  # type: ignore[arg-type]  # a Linear's weight (nn.Module's __getattr__ says Tensor | Module)
                    total += float(nll.sum())
                else:
                    total += (float(conditional_lm_loss(model(**inputs).logits, part["labels"]))
                              * part["labels"].shape[0])
        loss = {"heldout_loss": total / len(sub)}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, loss)
        except OSError:
            pass  # a cache that cannot be written costs the next run the time, nothing else
        return loss

    def _loss_key(self, sub: TextData) -> list[Any]:
        """Everything ``heldout_loss`` depends on: a digest of every weight of the model as loaded
        now (the frozen ones hashed once), the records, the prompt, the window, the precision and
        the hardware's bf16, and the libraries' versions."""
        import transformers

        from common.devices import native_bf16

        trainable = trainable_state(self.model)
        if self._frozen_digest is None:
            self._frozen_digest = _tensors_digest({k: v for k, v in self.model.state_dict().items()
                                                   if k not in trainable})
        device = next(self.model.parameters()).device.type
        return [self._frozen_digest, _tensors_digest(trainable), list(sub.texts), list(sub.codes),
                [self.prompt(c) for c in sorted(set(sub.codes))], self.cfg.max_length, self.cfg.precision, device,
                native_bf16(device), torch.__version__, transformers.__version__]


def _tensors_digest(tensors: Mapping[str, torch.Tensor | np.ndarray]) -> str:
    """sha256 of named tensors' (or arrays') names, dtypes, shapes and bytes."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = torch.as_tensor(tensors[name]).detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
