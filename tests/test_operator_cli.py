"""`fedsyn ledger` and `fedsyn node-check` as an operator meets them (issue 32's review)."""

from __future__ import annotations

import json
import math

from fedsyn_client.ledger import PrivacyLedger, set_budget
from fedsyn_server.cli import main


def test_a_ledger_that_was_ever_unlimited_is_shown_and_its_json_is_json(tmp_path, capsys):
    PrivacyLedger.open(tmp_path, budget=8.0)
    set_budget(tmp_path, math.inf, "a test without privacy")
    set_budget(tmp_path, 8.0, "back")
    assert main(["ledger", str(tmp_path)]) == 0
    assert "inf -> 8" in capsys.readouterr().out
    assert main(["ledger", str(tmp_path), "--json"]) == 0
    parsed = json.loads(capsys.readouterr().out, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert parsed["budget_changes"][0]["to"] == "inf"


def test_two_resets_in_one_second_keep_both_archives(tmp_path, capsys):
    for i in range(3):
        PrivacyLedger.open(tmp_path, budget=8.0)
        assert main(["ledger", str(tmp_path), "--reset", "--reason", f"reset {i}"]) == 0
    assert len(list(tmp_path.glob("ledger.*.archived.json"))) == 3


def test_budget_flags_say_what_they_do(tmp_path, capsys):
    PrivacyLedger.open(tmp_path, budget=8.0)
    assert main(["ledger", str(tmp_path), "--reset", "--set-budget", "5", "--reason", "r"]) == 2
    assert "--budget" in capsys.readouterr().err
    assert PrivacyLedger.open(tmp_path, budget=8.0).budget == 8.0  # nothing changed
    assert main(["ledger", str(tmp_path), "--set-budget", "inf", "--reason", "r"]) == 2
    assert "--unlimited" in capsys.readouterr().err
    assert main(["ledger", str(tmp_path), "--set-budget", "inf", "--unlimited", "--reason", "r"]) == 0
    assert PrivacyLedger(tmp_path / "ledger.json").budget == math.inf
    assert main(["ledger", str(tmp_path), "--reset", "--budget", "5", "--reason", "new data"]) == 0
    assert PrivacyLedger(tmp_path / "ledger.json").budget == 5.0


def test_an_unquoted_node_config_value_is_one_line_saying_how_to_quote(tmp_path, capsys):
    assert main(["node-check", "--node-config", f"tier=weak epsilon=8 state-dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'tier="weak"' in err and "Traceback" not in err
    assert main(["run", ".", "--dry-run", "--run-config", "dataset=notes.csv"]) == 2
    assert 'dataset="notes.csv"' in capsys.readouterr().err
