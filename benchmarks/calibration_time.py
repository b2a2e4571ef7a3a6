"""Usage: python -m benchmarks.calibration_time {pld,basic}

The default run's node-side noise solving under one rule: the strong node's profile, DP-SGD and
vote, the weak node's profile and vote, as the nodes solve them (``common.calibration``). Timed
as whole processes, pld against basic, by paired whole-process timing (benchmarks/README.md, issue 47)."""

from __future__ import annotations

import math
import sys

from common.accounting import calibrate
from common.calibration import Planned
from common.dp import DPSGD, GAUSSIAN

DELTA = 1e-5
PROFILE = Planned("profile", GAUSSIAN, 2.0, DELTA, 1.0)
# the default split with voters = "all": epsilon 8 = profile 2 + DP-SGD 3 + vote 3 (strong), 2 + 6 (weak)
STRONG = [PROFILE, Planned("train", DPSGD, 3.0, DELTA, sample_rate=32 / 1001, steps=6),
          Planned("vote", GAUSSIAN, 3.0, DELTA, math.sqrt(8))]
WEAK = [PROFILE, Planned("vote", GAUSSIAN, 6.0, DELTA, math.sqrt(8))]


def main(rule: str) -> None:
    """Solve both tiers' noise under ``rule`` and print them (strong, then weak)."""
    print(calibrate(STRONG, rule), calibrate(WEAK, rule))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "pld")
