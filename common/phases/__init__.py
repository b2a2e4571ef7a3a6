"""The release phases, one file each (issue 62): ``Phase`` and its registry, and the shipped four
registered in the order the nodes release them (a table's marginals, the profile, DP-SGD, the
votes: the profile before DP-SGD, ``strategies.text_stages``)."""

from common.phases.base import Phase, Pricing, is_phase, phase, phases, register, unregister
from common.phases.marginals import Marginals
from common.phases.profile import Profile
from common.phases.train import Train
from common.phases.vote import Vote

for _shipped in (Marginals(), Profile(), Train(), Vote()):
    register(_shipped)

__all__ = ["Marginals", "Phase", "Pricing", "Profile", "Train", "Vote", "is_phase", "phase", "phases", "register",
           "unregister"]
