"""Plug-in point 2: the refinement method that turns the synthetic pool into the final set.

A ``Refinement`` says whether it needs the nodes' noisy votes (stage 4), how large a
pool to generate, and which pool items to keep (stage 5). Built-ins:

- ``knn-vote`` (the paper): pool of s, keep A.4 draws weighted by the DP kNN votes.
- ``uniform`` (paper Table A.14 baseline): pool of s, keep A.4 draws with equal weights.
- ``none``: generate the final size directly (max(1, floor(r*s))), keep everything,
  so every method ends with the same number of texts and compares fairly.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np

from fedsyn_server.resampling import resample_by_code


class Refinement(ABC):
    """Interface of a refinement method (subclass it to plug in another)."""

    name: str = "base"
    needs_votes: bool = False

    def pool_size(self, num_synthetic: int, sampling_rate: float) -> int:
        """How many texts to generate in stage 3 (before allocation by the profile)."""
        return num_synthetic

    @abstractmethod
    def select(self, codes: list[str], votes: np.ndarray | None, sampling_rate: float, seed: int) -> np.ndarray:
        """Indices of the pool items kept in the final synthetic set."""


class KnnVoteRefinement(Refinement):
    """Paper Algorithm 1 stage 4-5: resample by aggregated DP votes (A.2 + A.4)."""

    name, needs_votes = "knn-vote", True

    def select(self, codes, votes, sampling_rate, seed):  # noqa: D102
        if votes is None:
            raise ValueError("knn-vote refinement needs votes")
        return resample_by_code(codes, votes, sampling_rate, seed)


class UniformRefinement(Refinement):
    """A.4 with equal weights: same pool and final size as knn-vote, no votes."""

    name = "uniform"

    def select(self, codes, votes, sampling_rate, seed):  # noqa: D102
        return resample_by_code(codes, None, sampling_rate, seed)


class NoRefinement(Refinement):
    """Generate the final size directly and keep it all."""

    name = "none"

    def pool_size(self, num_synthetic, sampling_rate):  # noqa: D102
        return max(1, math.floor(sampling_rate * num_synthetic))

    def select(self, codes, votes, sampling_rate, seed):  # noqa: D102
        return np.arange(len(codes))


REFINEMENTS: dict[str, type[Refinement]] = {
    cls.name: cls for cls in (KnnVoteRefinement, UniformRefinement, NoRefinement)
}


def build_refinement(name: str) -> Refinement:
    """The refinement method registered under ``name`` (see ``REFINEMENTS``)."""
    try:
        return REFINEMENTS[name]()
    except KeyError:
        raise ValueError(f"refinement {name!r} is unknown; choose one of {sorted(REFINEMENTS)}") from None
