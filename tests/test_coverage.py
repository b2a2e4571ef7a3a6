"""Which codes phase 1 learned (``strategies.coverage``): the maths (the pool it splits: tests/test_writers.py)."""

from __future__ import annotations

import numpy as np
import pytest

from strategies.coverage import finetune_coverage, pretrained_codes

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
