"""The run's stages, one list: the numbers the strategy, its logs, the checkpoint and the README use.

Algorithm 1 lists phase 1 (finetuning) before the profile; the strategy asks the profile first
(``strategies.text_stages``: a run whose profile cannot be had stops before DP-SGD is spent), so the
stages run 0, 2, 1, 3, 4, 5 and keep the paper's numbers. ``tests/test_stages.py`` holds the
README's stage table to this list.

A table run by marginals (``strategies.marginals``) is not a member: its marginals rounds stand in
place of stage 2 (they release the sites' counts, and with a free-text column the sampled rows'
codes allocate the text pool, so no profile is asked), but they are not a stage of Algorithm 1,
and a member of its own would need a number the paper's stages do not have (an ``IntEnum``
member with value 2 would be an alias of ``PROFILE``, with its label). So ``Stage`` stays the
paper's list; the docs call that step "stage M", and the checkpoint marks it done as
``common.dp.MARGINALS`` ("marginals") and a free-text column's texts attached as "free-text".
"""

from __future__ import annotations

from enum import IntEnum


class Stage(IntEnum):
    """A stage of a run; its value is its number, its ``label`` the name the checkpoint keeps."""

    TIERS = 0  # every node's tier and pre-flight (free)
    FINETUNE = 1  # DP federated finetuning on strong nodes (A.3)
    PROFILE = 2  # noisy per-code counts; their sum allocates the pool
    GENERATE = 3  # the pool, written by the pretrained and the finetuned weights
    REFINE = 4  # the refinement's vote rounds and resampling (A.2, A.4)
    LEDGERS = 5  # every node states this run's releases from its own ledger (free)

    @property
    def label(self) -> str:
        """The stage's name in logs, the checkpoint's ``completed`` list and the README."""
        return self.name.lower()

    def __str__(self) -> str:
        return f"stage {self.value} ({self.label})"
