"""Usage: python -m benchmarks.calibration_time {pld,basic}

The default run's node-side noise solving under one rule (argv[1]): the strong node's profile,
DP-SGD and vote, the weak node's profile and vote, as the nodes solve them (common.calibration)."""
import math, sys
from common.calibration import Planned, calibrate
from common.dp import DPSGD, GAUSSIAN
d = 1e-5
prof = Planned("profile", GAUSSIAN, 2.0, d, 1.0)
strong = [prof, Planned("train", DPSGD, 3.0, d, sample_rate=32 / 1001, steps=6), Planned("vote", GAUSSIAN, 3.0, d, math.sqrt(8))]
weak = [prof, Planned("vote", GAUSSIAN, 6.0, d, math.sqrt(8))]
print(calibrate(strong, sys.argv[1]), calibrate(weak, sys.argv[1]))
