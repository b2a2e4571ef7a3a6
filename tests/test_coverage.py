"""Which codes phase 1 learned (``strategies.coverage``): the maths, and the pool written by two weight sets."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from strategies.coverage import finetune_coverage, generate_by_coverage, pretrained_codes
from strategies.refinement import Generator

VOCAB = ["business", "politics", "sport", "tech"]


def test_a_code_the_strong_nodes_hold_none_of_has_coverage_near_zero():
    strong = [[-2.1, 0.4, 450.0, 370.0]]                      # noisy: holds sport and tech only
    weak = [[140.0, 130.0, 3.2, -1.0], [160.0, 110.0, 0.1, 0.3]]
    rho = finetune_coverage(strong, strong + weak)
    assert rho[2] > 1.5 and rho[3] > 1.5 and rho[0] < 0.01 and rho[1] < 0.01
    assert pretrained_codes(VOCAB, rho, 0.5) == ["business", "politics"]
    assert pretrained_codes(VOCAB, rho, 0.0) == []


def test_iid_profiles_keep_every_code_on_the_finetuned_model():
    rng = np.random.default_rng(0)
    shares = np.array([0.3, 0.2, 0.3, 0.2])
    nodes = [list(n * shares + rng.normal(0, 3, 4)) for n in (500, 500, 500, 500)]
    rho = finetune_coverage(nodes[:1], nodes)
    assert np.allclose(rho, 1, atol=0.15)
    assert pretrained_codes(VOCAB, rho, 0.5) == []


def test_no_strong_count_or_no_record_of_a_code_says_nothing():
    everyone = [[10.0, 0.0, 5.0, 5.0]]
    assert np.array_equal(finetune_coverage([], everyone), np.ones(4))
    assert np.array_equal(finetune_coverage([[-1.0, -2.0, -0.5, -3.0]], everyone), np.ones(4))
    rho = finetune_coverage([[10.0, -1.0, 0.0, 0.0]], everyone)
    assert rho[1] == 1.0 and rho[0] == pytest.approx(2.0) and rho[2] == 0.0  # politics: no record anywhere


class _Recorder(Generator):
    """Writes "<code>@<weight>" so that each text says which weights wrote it."""

    model = tokenizer = None

    def __init__(self) -> None:
        self.w = 0.0
        self.calls: list[dict[str, int]] = []

    def load(self, arrays):
        if arrays is not None:
            self.w = float(arrays.to_numpy_ndarrays()[0][0])
        return self.model

    def weights(self) -> ArrayRecord:
        return _arrays(self.w)

    def prompt(self, code: str) -> str:
        return code

    def generate(self, allocation: Mapping[str, int], seed: int):
        self.calls.append(dict(allocation))
        pairs = [(f"{c}@{self.w:g}", c) for c, n in allocation.items() for _ in range(n)]
        return [t for t, _ in pairs], [c for _, c in pairs]

    def variation(self, texts, codes, seed):
        return list(texts)

    def generation_report(self):
        return {"requested": sum(self.calls[-1].values())}


def _arrays(w: float) -> ArrayRecord:
    return ArrayRecord({"w": Array(np.array([w], dtype=np.float32))})


def test_the_pretrained_codes_are_written_by_theta0_and_the_rest_by_the_finetuned_weights():
    gen, alloc = _Recorder(), {"business": 2, "politics": 0, "sport": 3, "tech": 1}
    texts, codes, report = generate_by_coverage(gen, alloc, ["business", "politics"], _arrays(0), _arrays(1), seed=0)
    assert codes == ["business"] * 2 + ["sport"] * 3 + ["tech"]           # grouped in allocation order
    assert texts == ["business@0"] * 2 + ["sport@1"] * 3 + ["tech@1"]
    assert gen.w == 1.0                                                    # left on the finetuned weights
    assert report["pretrained_codes"] == ["business"]                      # politics got no text
    assert report["pretrained"] == {"requested": 2} and report["requested"] == 4


def test_with_no_pretrained_code_the_pool_is_one_call_on_the_finetuned_weights():
    gen, alloc = _Recorder(), {"sport": 2, "tech": 1}
    texts, codes, report = generate_by_coverage(gen, alloc, [], _arrays(0), _arrays(1), seed=0)
    assert texts == ["sport@1", "sport@1", "tech@1"] and len(gen.calls) == 1 and "pretrained" not in report
