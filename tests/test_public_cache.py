"""Issue 61: results on public inputs alone are kept across runs, keyed by all they depend on.

The held-out loss of theta^0 is the same in every run of a model, data set and settings, and was
5 s of the default run; a loss kept for other weights, records or settings must never be read.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord

from common.config import RunConfig
from common.data import TextData
from fedsyn_server.synthesis import ServerModel

HELD_OUT = TextData(["the match ended in a draw", "markets fell on monday", "a new phone is out"] * 3,
                    ["topic=a", "topic=b", "topic=a"] * 3)


def _counting(monkeypatch) -> list[int]:
    """Counts the losses computed (not read from the cache)."""
    import common.lm_loss as lm_loss

    done: list[int] = []
    for name in ("fused_sequence_nll", "conditional_lm_loss"):  # heldout_loss imports them when called
        real = getattr(lm_loss, name)
        monkeypatch.setattr(lm_loss, name, lambda *a, _real=real, **k: done.append(1) or _real(*a, **k))
    return done


def test_the_held_out_loss_is_kept_for_exactly_its_inputs(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSYN_CACHE", str(tmp_path))
    computed = _counting(monkeypatch)
    model = ServerModel(RunConfig(model="tiny-gpt2", max_length=16))
    theta0 = model.initial_arrays()
    first = model.heldout_loss(theta0, HELD_OUT)
    n = len(computed)
    assert n > 0 and list((tmp_path / "heldout-loss").glob("*.json"))
    # a fresh server (another run) reads it: the same number, nothing computed
    again = ServerModel(RunConfig(model="tiny-gpt2", max_length=16)).heldout_loss(theta0, HELD_OUT)
    assert again == first and len(computed) == n
    # other trainable weights, other frozen weights (another seed's tiny model), other records or
    # another window: computed, not read
    moved = ArrayRecord({k: Array(v.numpy() + np.float32(0.01)) for k, v in theta0.items()})
    assert model.heldout_loss(moved, HELD_OUT) != first and len(computed) > n
    for other, data in ((ServerModel(RunConfig(model="tiny-gpt2", max_length=16, seed=1)), HELD_OUT),
                        (ServerModel(RunConfig(model="tiny-gpt2", max_length=16)), HELD_OUT.subset(range(4))),
                        (ServerModel(RunConfig(model="tiny-gpt2", max_length=8)), HELD_OUT)):
        n = len(computed)
        other.heldout_loss(other.initial_arrays(), data)
        assert len(computed) > n
    assert len(list((tmp_path / "heldout-loss").glob("*.json"))) == 5
