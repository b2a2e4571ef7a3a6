"""How the numeric libraries' threads wait, set before any of them loads (issue 75).

torch's CPU kernels run on GNU OpenMP threads that, between parallel regions, spin for a while
(libgomp's default: 300,000 iterations) before they sleep. Alone on a machine that costs nothing;
with one other busy process on two cores the spinning threads take the cores the working ones
need: generating the default run's texts went from about 30 s to 9 minutes under one competing
process. A shorter spin, ``GOMP_SPINCOUNT=10000``, keeps the threads hot across back-to-back kernels
and lets them sleep soon when nothing comes. Measured (benchmarks/README.md#issue-75, the default run,
2 cores): idle 103 s against 99 s with libgomp's default and 112 s with ``OMP_WAIT_POLICY=PASSIVE``
(sleep at once, the first fix: every kernel then pays a wake-up); beside one busy process 213 s
(2.1x its idle) against 163 s with PASSIVE and more than 900 s with the default. So a run on an idle
machine, the common case, pays 4 % instead of 13 %, and a loaded one stays within the issue's 2.5x.
libgomp reads the variables once, when it is loaded (with torch), so they are set here, in the
package every fedsyn process imports before torch; an operator's own ``GOMP_SPINCOUNT`` or
``OMP_WAIT_POLICY`` is kept (PASSIVE for a machine that is always shared).
"""

from __future__ import annotations

import os

SPIN_COUNT = "10000"
OPERATOR_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def quiet_waiting(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """Set ``GOMP_SPINCOUNT`` to ``SPIN_COUNT`` in ``environ`` unless the operator set it or
    ``OMP_WAIT_POLICY``; returns the setting in force, as ``NAME=value``."""
    for key in OPERATOR_KEYS:
        if key in environ:
            return f"{key}={environ[key]}"
    environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return f"GOMP_SPINCOUNT={SPIN_COUNT}"
