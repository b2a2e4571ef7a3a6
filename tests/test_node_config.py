"""Issue 62: the node config is declared once (``fedsyn_client.policy.node_table``), and read by it.

Every key has a doc; an unknown key, a missing required key and a bad value each stop the node
with one line naming the key; ``NODE_KEYS`` is the table's; each phase gets its cap key; and the
deployment docs name exactly the table's keys.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from common.dp import PHASES
from fedsyn_client import policy
from fedsyn_client.policy import NODE_KEYS, PolicyError, node_table, policy_from_node_config

ROOT = Path(__file__).resolve().parents[1]
VALID = {"tier": "weak", "data-path": "x.csv", "epsilon": 8.0, "max-records": 100}
SCHEMA = '{"columns": [{"name": "sex", "type": "categorical", "categories": ["f", "m"]}]}'

# a value each key refuses (the caps: above epsilon; measurable-columns: without a table-schema), so
# that every key read by more than str() has a case here (test_every_checked_key_has_a_bad_value_case);
# None: the key takes any value
BAD = {
    "tier": "medium", "data-path": " ", "text-column": "topic", "control-columns": "", "table-schema": "{bad",
    "control-codes": None, "epsilon": 0, "delta": 1, "cap-window-days": -1, "model": "", "embedder": ",",
    "finetune": "lora,qlora", "max-unconfirmed-holds": 1.5, "keep-replies-days": "forever", "max-length": 7,
    "max-records": 0, "accounting": "rdp", "measurable-columns": "sex", "min-honest-nodes": 0,
    "peer-keys": "/no/such/peer-keys.txt", "identity-key": "/no/such/node.key", "vote-window": 33,
    "vote-precision": "bf16", "max-candidates": 0, "max-local-steps": 0, "max-batch-size": 0, "max-rounds": 0,
    "max-marginal-cells": 0, "max-open-rounds": 0,
    **{f"max-epsilon-{phase}": 9.0 for phase in PHASES},
}


def test_node_keys_is_the_tables_and_every_key_has_a_one_line_doc():
    table = node_table()
    assert NODE_KEYS == tuple(key.name for key in table)
    assert len(set(NODE_KEYS)) == len(NODE_KEYS)
    for key in table:
        assert re.fullmatch(r"[a-z][a-z0-9]*(-[a-z0-9]+)*", key.name), key.name  # kebab-case, as typed
        assert key.doc.strip() and "\n" not in key.doc, key.name
        assert not key.policy_field or key.policy_field in policy.NodePolicy.__dataclass_fields__, key.name
    assert {"tier", "data-path", "epsilon", "max-records"} == {key.name for key in table if key.required}


def test_each_phase_gets_its_cap_key_from_the_phase_list_it_is_given(monkeypatch):
    assert {f"max-epsilon-{phase}" for phase in PHASES} <= set(NODE_KEYS)
    assert "max-epsilon-audit" in {key.name for key in node_table((*PHASES, "audit"))}
    # a newly registered phase (common.phases) needs no line in the table: the cap key follows it
    monkeypatch.setattr(policy, "_phase_names", lambda: (*PHASES, "audit"))
    assert policy_from_node_config({**VALID, "max-epsilon-audit": 1.5}).cap("audit") == 1.5


def test_an_unknown_key_is_refused_naming_it_and_every_allowed_key():
    with pytest.raises(PolicyError, match=r"unknown node-config key\(s\) \['epsilom'\]: a misspelt key would be "
                                          r"ignored; allowed: ") as err:
        policy_from_node_config({**VALID, "epsilom": 3})
    assert str(err.value).endswith(", ".join(NODE_KEYS))


def test_a_policy_file_takes_the_same_keys_but_not_itself(tmp_path):
    file = tmp_path / "policy.toml"
    file.write_text('tier = "strong"\nepsilon = 3.0\nmax_epsilon_vote = 1.0\n')
    policy_ = policy_from_node_config({"data-path": "x.csv", "max-records": 10, "epsilon": 2.0,
                                       "policy-file": str(file)})
    assert (policy_.tier, policy_.epsilon, policy_.cap("vote")) == ("strong", 2.0, 1.0)  # node-config keys win
    file.write_text('policy-file = "other.toml"\nepsilom = 1\n')
    with pytest.raises(PolicyError, match=r"unknown policy key\(s\) \['epsilom', 'policy-file'\]") as err:
        policy_from_node_config({**VALID, "policy-file": str(file)})
    assert str(err.value).endswith(", ".join(k for k in NODE_KEYS if k != "policy-file"))


@pytest.mark.parametrize("name", [key.name for key in node_table() if key.required])
def test_a_missing_required_key_is_named_with_how_to_set_it(name):
    with pytest.raises(PolicyError, match=f"node-config {name} ") as err:
        policy_from_node_config({k: v for k, v in VALID.items() if k != name})
    assert "set" in str(err.value).lower()


@pytest.mark.parametrize("name", sorted(k for k, v in BAD.items() if v is not None))
def test_a_bad_value_is_refused_naming_its_key(name):
    with pytest.raises(PolicyError, match="^node-config ") as err:
        policy_from_node_config({**VALID, name: BAD[name]})
    assert re.search(rf"\b{name} ", str(err.value)), str(err.value)


def test_every_checked_key_has_a_bad_value_case():
    # a key added to the table with a parser or a check must add its refusal above
    checked = {key.name for key in node_table() if key.checks or key.required or key.parse is not policy._verbatim}
    assert checked <= set(BAD), sorted(checked - set(BAD))


def test_defaults_build_the_policy_of_the_table():
    built = policy_from_node_config(VALID)
    for key in node_table():
        if key.policy_field and not key.required:
            assert getattr(built, key.policy_field) == key.default, key.name
    assert built.phase_caps == () and built.table_schema == "" and built.warnings  # no control-codes: a warning
    table = policy_from_node_config({**VALID, "table-schema": SCHEMA, "control-columns": "sex", "text-column": "x"})
    assert table.measurable_columns == () and '"sex"' in table.table_schema


def _documented_keys(text: str) -> set[str]:
    """The node-config keys a page uses: those set in a ``--node-config '...'`` example and those
    written as node-config `key`."""
    keys = {m.group(1) for m in re.finditer(r"node-config\s+`([a-z][a-z0-9-]*)`", text)}
    for example in re.finditer(r"--node-config\s+'([^']*)'", text):
        keys |= {m.group(1) for m in re.finditer(r"(?:^|\s)([A-Za-z][\w-]*)=", example.group(1))}
    return keys


def test_the_deployment_docs_name_exactly_the_tables_keys():
    deployment = (ROOT / "docs" / "deployment.md").read_text(encoding="utf-8")
    missing = [k for k in NODE_KEYS if f"`{k}`" not in deployment]
    assert not missing, f"docs/deployment.md does not document node-config keys {missing}"
    readme = (ROOT / "deploy" / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("| key | required | meaning |"):].split("\n\n")[0]  # the node-config table
    rows = re.findall(r"^\| (`[a-z][a-z0-9-]*`(?:, `[a-z][a-z0-9-]*`)*) \|", table, flags=re.MULTILINE)
    in_table = {k for row in rows for k in re.findall(r"`([^`]+)`", row)}
    keys = set(NODE_KEYS)
    assert in_table == keys, (f"deploy/README.md's node-config table: missing {sorted(keys - in_table)}, "
                              f"not keys {sorted(in_table - keys)}")
    pages = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md", ROOT / "README.md"]
    for page in pages:
        unknown = _documented_keys(page.read_text(encoding="utf-8")) - set(NODE_KEYS)
        assert not unknown, f"{page.relative_to(ROOT)} documents node-config keys the node refuses: {sorted(unknown)}"
