"""Accounting rules are objects behind one interface, with a registry (issue 62).

The node, ``fedsyn plan`` and the run config look a rule up by its name and call it; nothing in
the packages branches on a rule's name. A rule registered from outside the packages is accepted
by the run config and prices a plan.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from common import accounting
from common.accounting import Accounting, Basic, Pld, calibrate, register, rule
from common.calibration import Planned
from common.config import ConfigError, RunConfig
from common.dp import GAUSSIAN

ROOT = Path(__file__).resolve().parents[1]
PLAN = [Planned("profile", GAUSSIAN, 2.0, 1e-5), Planned("vote", GAUSSIAN, 6.0, 1e-5, sensitivity=math.sqrt(8))]


class Doubled(Basic):
    """A toy rule: twice the basic noise (a stricter institution's)."""

    name = "doubled"

    def noises(self, planned: tuple[Planned, ...], delta: float) -> tuple[float, ...]:
        return tuple(2 * n for n in super().noises(planned, delta))


@pytest.fixture
def doubled():
    registered = register(Doubled())
    try:
        yield registered
    finally:
        del accounting.RULES[registered.name]


def test_the_shipped_rules_are_registered_objects_and_pld_is_the_default():
    assert isinstance(rule("basic"), Basic) and isinstance(rule("pld"), Pld)
    assert RunConfig().accounting == accounting.DEFAULT == "pld"
    with pytest.raises(ValueError, match="unknown accounting rule 'advanced'"):
        rule("advanced")
    with pytest.raises(ValueError, match="registered already"):
        register(Pld())
    with pytest.raises(TypeError, match="subclass common.accounting.Accounting"):
        register("pld")  # type: ignore[arg-type]  # the refusal under test


def test_calibrate_dispatches_to_the_named_rules_object():
    basic, pld = calibrate(PLAN, "basic", 1e-5), calibrate(PLAN, "pld", 1e-5)
    assert basic == list(Basic().noises(tuple(PLAN), 1e-5)) and pld == list(Pld().noises(tuple(PLAN), 1e-5))
    assert basic != pld and all(0 < n < math.inf for n in basic + pld)
    assert calibrate([Planned("vote", GAUSSIAN, math.inf, 1e-5)], "pld") == [0.0]  # no DP: no noise


def test_a_rule_registered_outside_the_packages_is_a_run_configs_and_prices_the_plan(doubled):
    assert RunConfig.from_flower({"accounting": "doubled"}).accounting == "doubled"
    assert calibrate(PLAN, "doubled", 1e-5) == pytest.approx([2 * n for n in calibrate(PLAN, "basic", 1e-5)])
    with pytest.raises(ConfigError, match="accounting"):
        RunConfig.from_flower({"accounting": "tripled"})


def test_every_rule_method_is_abstract_on_the_interface():
    """A new rule must say what it does at every place a release is priced, not inherit a default."""
    assert {"noises", "release_delta", "composed_at", "terms", "gaussian_multiplier", "gaussian_charge",
            "dpsgd_noise", "dpsgd_epsilon", "ledger_epsilon"} <= Accounting.__abstractmethods__


def test_no_package_module_branches_on_a_rules_name():
    pattern = re.compile(r"""(==|!=|\bin\b)\s*(BASIC|PLD|["'](basic|pld)["'])|accounting\s*(==|!=)""")
    hits = [f"{path.relative_to(ROOT)}:{n}" for pkg in ("common", "fedsyn_client", "fedsyn_server", "strategies")
            for path in (ROOT / pkg).rglob("*.py")
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line.split("#")[0])]
    assert hits == []
