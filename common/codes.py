"""Control codes: the public labels every record carries, and the prompts made from them.

A control code is one string per record, built from one or more public columns as
``col=value|col=value`` (e.g. ``topic=sport``). The vocabulary is public and fixed
before the run; it never comes from counting private records.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

CODE_FIELD_SEP = "|"
CODE_KV_SEP = "="
# The separator between the control-code prompt and the text (paper eq. 3: the code is
# the prompt). A newline pair keeps the prompt readable and is one or two BPE tokens.
PROMPT_SEPARATOR = "\n\n"


def make_code(values: Mapping[str, object], columns: Sequence[str]) -> str:
    """Join a record's control-column values into one code string ``col=value|...``."""
    return CODE_FIELD_SEP.join(f"{c}{CODE_KV_SEP}{_clean(values[c])}" for c in columns)


def parse_code(code: str) -> dict[str, str]:
    """Split ``col=value|col=value`` back into a column -> value dict."""
    fields = {}
    for part in code.split(CODE_FIELD_SEP):
        key, _, value = part.partition(CODE_KV_SEP)
        fields[key] = value
    return fields


def code_prompt(code: str) -> str:
    """The generation / training prompt for a code: ``"topic: sport\\n\\n"``.

    Training text is ``code_prompt(code) + text + eos``; generation prompts with the same
    string, so the finetuned model continues in the code's style.
    """
    fields = parse_code(code)
    return ", ".join(f"{k}: {v}" for k, v in fields.items()) + PROMPT_SEPARATOR


def zero_shot_prompt(code: str, template: str) -> str:
    """An appendix-C style instruction for a pretrained model, e.g. ``Please generate a
    news article about topic: sport:\n\n``; ``{fields}`` is replaced by ``col: value, ...``."""
    fields = ", ".join(f"{k}: {v}" for k, v in parse_code(code).items())
    return template.replace("{fields}", fields)


def make_prompt(code: str, style: str = "code", template: str = "") -> str:
    """The one prompt of ``code`` that phase 1 trains on and generation uses (run-config
    ``prompt``): ``"code"`` the paper's bare code (``code_prompt``); ``"instruction"`` and
    ``"zero-shot"`` the instruction ``template`` filled with the code (``zero_shot_prompt``).
    With ``"instruction"`` and a LoRA adapter initialised to zero, the model before the first
    DP step is exactly the zero-shot generator: DP steps refine what it knows."""
    return code_prompt(code) if style == "code" else zero_shot_prompt(code, template)


# What stands for a control value in the prompt without a code (classifier-free guidance's other
# prompt): the same words around it, so that the two prompts differ only in the code.
ANY_VALUE = "any"


def unconditional_prompt(code: str, style: str = "code", template: str = "") -> str:
    """``make_prompt`` with every value of ``code`` replaced by ``ANY_VALUE``: e.g. ``Please generate
    a news article about topic: any:\n\n``. Classifier-free guidance (run-config ``guidance``)
    contrasts the model's next-token distribution under the code's prompt with this one, so the
    instruction's own words cancel and what the code changes is amplified."""
    neutral = CODE_FIELD_SEP.join(f"{key}{CODE_KV_SEP}{ANY_VALUE}" for key in parse_code(code))
    return make_prompt(neutral, style, template)


def _clean(value: object) -> str:
    # Separators inside a value would make the code unparseable; they are replaced,
    # not escaped, because codes are labels, not free text.
    return str(value).strip().replace(CODE_FIELD_SEP, "/").replace(CODE_KV_SEP, "-")


def control_value(value: object) -> str | None:
    """A control value as the text its code carries, from that value alone (None: missing).

    One record's code must never depend on the other rows: pandas infers a column's type from the
    whole file, so one record ``4.5`` in a column of ``4``s would turn every ``stars=4`` into
    ``stars=4.0`` and move all of them out of their code at once (a change far beyond the
    sensitivity the noise is calibrated for). So a node reads control columns as text
    (``load_table(..., text_columns=...)``), and each value is written by one rule: a string is
    stripped as it is (``01`` stays ``01``); a number (from JSON or Parquet, where the file types
    it) is an integer when integral (``4.0`` and ``4`` are ``4``, whatever else the column holds)
    and Python's shortest repr otherwise (``4.5``); a bool is ``true``/``false``; an empty string,
    None or NaN is missing.
    """
    if value is None or isinstance(value, (bool, np.bool_)):
        return None if value is None else ("true" if value else "false")
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        if math.isnan(value):
            return None
        return str(int(value)) if math.isfinite(value) and float(value).is_integer() else repr(float(value))
    if value is pd.NA or value is pd.NaT:
        return None
    text = str(value).strip()
    return text or None
