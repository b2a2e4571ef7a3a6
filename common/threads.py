"""How the numeric libraries' threads wait, set before any of them loads (issue 75).

torch's CPU kernels run on GNU OpenMP threads that, between parallel regions, spin for a while
before they sleep. Alone on a machine that costs nothing; with one other busy process on two cores
the spinning threads take the cores the working ones need: generating the default run's texts went
from about 30 s to 9 minutes under one competing process. ``OMP_WAIT_POLICY=PASSIVE`` makes a
waiting thread sleep at once: the run then slows in proportion to the load (measured in
benchmarks/README.md#issue-75). libgomp reads the variable once, when it is loaded (with torch), so it
is set here, in the package every fedsyn process imports before torch; an operator's or a user's own
setting is kept.
"""

from __future__ import annotations

import os

WAIT_POLICY = "PASSIVE"


def quiet_waiting(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """Set ``OMP_WAIT_POLICY`` to ``WAIT_POLICY`` in ``environ`` unless it is set; returns the value
    in force."""
    return environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
