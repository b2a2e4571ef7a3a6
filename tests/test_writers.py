"""Who writes the pool (``strategies.writers``): the split, the two writers, the tags through
resampling and refinements, and what the votes kept. Pure: a recording generator, no Flower."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from common.config import RunConfig
from strategies.knn_vote import ContrastiveVoteRefinement, NoRefinement
from strategies.private_evolution import PrivateEvolution
from strategies.refinement import FINETUNED, PRETRAINED, Generator, RefinementContext
from strategies.resampling import resample_by_code
from strategies.writers import better_writer, effective_share, generate_pool, kept_shares, pretrained_counts, writers_of


class Recorder(Generator):
    """Writes "<code>@<weight>#<k>" so that each text says which weights wrote it; records the prompt style."""

    model = tokenizer = None

    def __init__(self) -> None:
        self.w = 0.0
        self.calls: list[tuple[dict[str, int], str | None]] = []

    def load(self, arrays):
        if arrays is not None:
            self.w = float(arrays.to_numpy_ndarrays()[0][0])
        return self.model

    def weights(self) -> ArrayRecord:
        return arrays(self.w)

    def prompt(self, code: str) -> str:
        return code

    def generate(self, allocation: Mapping[str, int], seed: int, prompt: str | None = None):
        self.calls.append((dict(allocation), prompt))
        pairs = [(f"{c}@{self.w:g}#{k}", c) for c, n in allocation.items() for k in range(n)]
        return [t for t, _ in pairs], [c for _, c in pairs]

    def variation(self, texts, codes, seed):
        return [f"{t}+v" for t in texts]

    def generation_report(self):
        return {"requested": sum(self.calls[-1][0].values())}


def arrays(w: float) -> ArrayRecord:
    return ArrayRecord({"w": Array(np.array([w], dtype=np.float32))})


def test_the_share_applies_only_where_two_writers_exist_and_a_vote_judges_them():
    assert effective_share(0.4, finetuned=True, votes=True)[0] == 0.4
    share, why = effective_share(0.4, finetuned=True, votes=False)
    assert share == 0.0 and "finetuned model" in why and "pretrained-share does not apply" in why
    share, why = effective_share(0.4, finetuned=False, votes=True)
    assert share == 1.0 and "pretrained model" in why
    # POPri and GRPO train the writer on its own samples: none of the pool is the pretrained model's
    share, why = effective_share(0.4, finetuned=True, votes=True, on_policy=True)
    assert share == 0.0 and "own samples" in why
    assert effective_share(0.4, finetuned=False, votes=True, on_policy=True)[0] == 1.0  # θ⁰ is then the writer trained


def test_each_code_gets_its_share_rounded_half_up_and_coverage_floor_codes_all_of_it():
    alloc = {"a": 5, "b": 4, "c": 1, "d": 0}
    assert pretrained_counts(alloc, 0.5) == {"a": 3, "b": 2, "c": 1, "d": 0}
    assert pretrained_counts(alloc, 0.0) == {"a": 0, "b": 0, "c": 0, "d": 0}
    assert pretrained_counts(alloc, 0.25, whole=["b"]) == {"a": 1, "b": 4, "c": 0, "d": 0}
    assert pretrained_counts(alloc, 1.0) == alloc


def test_the_pool_is_written_by_theta0_with_the_instruction_and_by_the_finetuned_weights():
    gen, alloc = Recorder(), {"a": 3, "b": 0, "c": 2}
    pool = generate_pool(gen, alloc, pretrained_counts(alloc, 0.5), arrays(0), arrays(1), seed=0)
    assert pool.codes == ["a"] * 3 + ["c"] * 2                               # grouped in allocation order
    assert pool.texts == ["a@0#0", "a@0#1", "a@1#0", "c@0#0", "c@1#0"]       # θ⁰'s first within a code
    assert pool.writers == [PRETRAINED, PRETRAINED, FINETUNED, PRETRAINED, FINETUNED]
    assert gen.calls == [({"a": 2, "c": 1}, "instruction"), ({"a": 1, "b": 0, "c": 1}, None)]
    assert gen.w == 1.0                                                        # left on the finetuned weights
    assert pool.report["writers"] == {"a": {FINETUNED: 1, PRETRAINED: 2}, "c": {FINETUNED: 1, PRETRAINED: 1}}
    assert pool.report["pretrained"] == {"requested": 3} and pool.report["requested"] == 2


def test_share_zero_is_one_call_on_the_finetuned_weights_and_no_phase_1_is_all_pretrained():
    gen, alloc = Recorder(), {"a": 2, "b": 1}
    pool = generate_pool(gen, alloc, pretrained_counts(alloc, 0.0), arrays(0), arrays(1), seed=0)
    assert pool.writers == [FINETUNED] * 3 and len(gen.calls) == 1 and "pretrained" not in pool.report
    gen = Recorder()
    pool = generate_pool(gen, alloc, pretrained_counts(alloc, 1.0), arrays(0), arrays(0), seed=0, finetuned=False)
    assert pool.writers == [PRETRAINED] * 3 and gen.calls == [(alloc, None)]   # the run's own prompt


def _context(gen: Recorder, pool, votes_for, cfg: RunConfig | None = None) -> RefinementContext:
    cfg = cfg or RunConfig(sampling_rate=0.5, refinement_rounds=2, writer_choice="mix")
    return RefinementContext(cfg=cfg, texts=list(pool.texts), codes=list(pool.codes), allocation={}, profile=np.ones(1),
                             vocabulary=sorted(set(pool.codes)), generator=gen,
                             vote=lambda texts, codes, **_: votes_for(texts), rng=np.random.default_rng(0),
                             writers=list(pool.writers), writer=FINETUNED)


@pytest.mark.parametrize("favoured", [PRETRAINED, FINETUNED])
def test_a_writer_voted_down_leaves_the_final_set_to_the_other_and_the_tags_survive(favoured):
    gen, alloc = Recorder(), {"a": 8, "b": 6}
    pool = generate_pool(gen, alloc, pretrained_counts(alloc, 0.5), arrays(0), arrays(1), seed=0)
    weight = "@0#" if favoured == PRETRAINED else "@1#"
    # the voters' records sit near one writer's texts: the other writer's get negative noisy votes
    votes = lambda texts: np.array([3.0 + i % 3 if weight in t else -2.0 for i, t in enumerate(texts)])  # noqa: E731
    refined = ContrastiveVoteRefinement().refine(_context(gen, pool, votes))
    kept = [refined.writers[i] for i in refined.selected]
    assert len(kept) == 4 + 3 and set(kept) == {favoured}
    assert all((weight in refined.texts[i]) for i in refined.selected)          # the tag is the text's writer
    assert kept_shares(refined.codes, refined.writers, refined.selected) == {
        c: {PRETRAINED: float(favoured == PRETRAINED), FINETUNED: float(favoured == FINETUNED)} for c in alloc}
    # A.4 itself, without the refinement: the same selection from the same votes
    assert np.array_equal(refined.selected, resample_by_code(pool.codes, votes(pool.texts), 0.5, 0))


def test_the_better_voted_writer_takes_the_code_and_a_short_writer_is_topped_up():
    codes = ["a"] * 6 + ["b"] * 4
    writers = [PRETRAINED] * 3 + [FINETUNED] * 3 + [PRETRAINED, PRETRAINED, FINETUNED, FINETUNED]
    votes = np.array([5.0, -3.0, 4.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    mask = better_writer(codes, writers, votes)
    # a: θ⁰'s mean clamped vote (9/3) beats the finetuned (1); b: a tie goes to the finetuned model
    assert mask.tolist() == [True] * 3 + [False] * 3 + [False, False, True, True]
    assert better_writer(codes, writers, votes, "mix") is None and better_writer(codes, writers, None) is None
    assert better_writer(codes, [FINETUNED] * 10, votes) is None              # one writer: the whole pool
    chosen = resample_by_code(codes, votes, 0.5, seed=0, among=mask)
    assert sorted(chosen[:3].tolist()) == [0, 1, 2] and sorted(chosen[3:].tolist()) == [8, 9]
    # M = 4 of a's 6 at r = 2/3: θ⁰'s 3 texts, then one more drawn among the finetuned model's
    more = resample_by_code(codes, votes, 2 / 3, seed=0, among=mask)
    assert set(more[:3].tolist()) == {0, 1, 2} and more[3] in (3, 4, 5)
    # with every text eligible the draw is A.4's exactly
    assert np.array_equal(resample_by_code(codes, votes, 0.5, 3, among=np.ones(10, bool)),
                          resample_by_code(codes, votes, 0.5, 3))


def test_writer_choice_better_keeps_only_each_codes_better_voted_writers_texts():
    gen, alloc = Recorder(), {"a": 8, "b": 6}
    pool = generate_pool(gen, alloc, pretrained_counts(alloc, 0.5), arrays(0), arrays(1), seed=0)
    # a's θ⁰ texts and b's finetuned texts are voted up a little; the other writer's vary around 0
    votes = lambda texts: np.array([(1.0 if ("a@0" in t or "b@1" in t) else 0.0) + (i % 4) * 0.3  # noqa: E731
                                    for i, t in enumerate(texts)])
    cfg = RunConfig(sampling_rate=0.25, writer_choice="better")
    refined = ContrastiveVoteRefinement().refine(_context(gen, pool, votes, cfg))
    assert kept_shares(refined.codes, refined.writers, refined.selected) == {
        "a": {PRETRAINED: 1.0, FINETUNED: 0.0}, "b": {PRETRAINED: 0.0, FINETUNED: 1.0}}
    # the default ("mix") draws from both writers' texts of each code by their votes alone
    assert RunConfig().writer_choice == "mix"
    mixed = ContrastiveVoteRefinement().refine(_context(gen, pool, votes, RunConfig(sampling_rate=0.25)))
    assert any(0 < share[PRETRAINED] < 1 for share in kept_shares(mixed.codes, mixed.writers, mixed.selected).values())


def test_pe_children_are_the_finetuned_writers_and_survivors_keep_theirs():
    gen, alloc = Recorder(), {"a": 4}
    pool = generate_pool(gen, alloc, pretrained_counts(alloc, 0.5), arrays(0), arrays(1), seed=0)
    votes = lambda texts: np.array([5.0 if "@0#" in t else 0.0 for t in texts])  # noqa: E731
    refined = PrivateEvolution().refine(_context(gen, pool, votes))
    by_text = dict(zip(refined.texts, refined.writers))
    assert by_text["a@0#0"] == by_text["a@0#1"] == PRETRAINED                # θ⁰'s texts survived
    assert [w for t, w in by_text.items() if t.endswith("+v")] == [FINETUNED, FINETUNED]
    assert {r["writer"] for r in refined.history} == {PRETRAINED, FINETUNED}


def test_a_population_without_writers_is_tagged_from_the_pool_and_the_generator():
    pool_texts, pool_writers = ["x", "y"], [PRETRAINED, FINETUNED]
    assert writers_of(["y", "z", "x"], pool_texts, pool_writers, "refined") == [FINETUNED, "refined", PRETRAINED]
    gen, alloc = Recorder(), {"a": 2}
    pool = generate_pool(gen, alloc, pretrained_counts(alloc, 0.5), arrays(0), arrays(1), seed=0)
    assert NoRefinement().refine(_context(gen, pool, lambda t: np.zeros(len(t)))).writers == pool.writers
