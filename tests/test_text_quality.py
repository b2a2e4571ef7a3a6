"""The usable-text checks (pure): each reason on a text that has it, and none on real prose."""

from __future__ import annotations

import pytest

from fedsyn_server.text_quality import EMPTY, PROMPT_COPY, REPETITION, trim_cut, unusable

PROMPT = "topic: sport\n\n"
PROSE = ("The prime minister told parliament on Tuesday that the prime minister's office would publish the "
         "budget, and the prime minister's critics said the plan came too late for the schools it promised to fund.")


@pytest.mark.parametrize("text,reason", [
    ("", EMPTY), ("   \n\t ", EMPTY),
    ("topic: sport", PROMPT_COPY), ("Topic: Sport.\nThe match was won", PROMPT_COPY),
    ("goal goal goal goal goal goal", REPETITION),
    ("and then he said and then he said and then he said and then he said", REPETITION),
    ("the team won the game . the team won the game . the team won the game . the end", REPETITION),
    (PROSE, None), ("The striker scored twice in the second half.", None), ("Sport: a short note", None),
])
def test_each_reason_and_none_on_prose(text, reason):
    assert unusable(text, PROMPT) == reason


def test_a_text_stopped_by_the_limit_loses_its_last_word_only():
    assert trim_cut("The striker scored twi", hit_limit=True) == "The striker scored"
    assert trim_cut("The striker scored twice.", hit_limit=False) == "The striker scored twice."
    assert trim_cut("Incompl", hit_limit=True) == ""
