"""Issue 75, finding 4: generation collapsed under one competing process (about 30 s idle, 9 minutes
with one other busy process on two cores) because torch's OpenMP threads spin while they wait. Every
fedsyn process shortens the spin (``GOMP_SPINCOUNT``) before torch loads (``common.threads``), keeping
an operator's own setting; the speed it buys is measured in benchmarks/README.md#issue-75, not here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.threads import OPERATOR_KEYS, SPIN_COUNT, quiet_waiting

PROBE = ("import sys, os; import {module}; "
         "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")


def _fresh(module: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in OPERATOR_KEYS} | env
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], capture_output=True, text=True,
                         env=clean, check=True, timeout=300)
    return out.stdout.split()


@pytest.mark.parametrize("module", ["fedsyn_client.client_app", "fedsyn_server.server_app", "fedsyn_server.cli"])
def test_every_entry_point_shortens_the_spin_before_torch_loads(module: str) -> None:
    spin, policy, _ = _fresh(module)
    assert (spin, policy) == (SPIN_COUNT, "None")
    spin, _, torch_loaded = _fresh("common")
    assert (spin, torch_loaded) == (SPIN_COUNT, "False")  # set by the first fedsyn import, torch not yet there


def test_an_operators_own_setting_is_kept() -> None:
    assert _fresh("fedsyn_client.client_app", OMP_WAIT_POLICY="PASSIVE")[:2] == ["None", "PASSIVE"]
    assert _fresh("fedsyn_client.client_app", GOMP_SPINCOUNT="500")[:2] == ["500", "None"]
    env = {"OMP_WAIT_POLICY": "active"}
    assert quiet_waiting(env) == "OMP_WAIT_POLICY=active" and env == {"OMP_WAIT_POLICY": "active"}
    fresh: dict[str, str] = {}
    assert quiet_waiting(fresh) == f"GOMP_SPINCOUNT={SPIN_COUNT}" and fresh == {"GOMP_SPINCOUNT": SPIN_COUNT}
