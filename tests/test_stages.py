"""One list of stage numbers (issue 62): the README's stage table is ``strategies.stages.Stage``."""

from __future__ import annotations

import re
from pathlib import Path

from strategies.stages import Stage

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readmes_stage_table_is_the_codes_list_of_stages():
    rows = re.findall(r"^\| (\d+)\. ([a-z]+)\b", README.read_text(), flags=re.M)
    assert [(int(n), name) for n, name in rows] == [(s.value, s.label) for s in Stage]


def test_a_stage_says_its_number_and_name_in_the_logs():
    assert str(Stage.REFINE) == "stage 4 (refine)" and Stage.PROFILE.label == "profile"


def test_the_checkpoints_stage_names_are_the_stages_labels():
    """A checkpoint written before the stages were one list reads the same names."""
    assert {s.label for s in Stage} >= {"profile", "finetune", "generate", "refine"}


def test_the_readme_stays_within_150_lines():
    assert len(README.read_text().splitlines()) <= 150
