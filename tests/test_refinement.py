"""The refinement stage as a plug-in: the maths of PE and POPri, the histograms' sensitivity,
every built-in through the strategy with the real ClientApp, a class by path, and a server
that asks for more vote rounds than the nodes' budgets allow."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from common import records as R
from common.config import ConfigError, RunConfig
from common.histograms import HISTOGRAMS
from common.io import read_jsonl
from common.voting import contrastive_votes, knn_votes, similarity_scores
from fedsyn_server.outputs import write_outputs
from strategies.popri import preference_pairs
from strategies.private_evolution import next_generation
from strategies.refinement import Refinement, build_refinement
from strategies.resampling import resample_by_code
from tests import test_strategy
from tests.test_strategy import nodes_for, run, run_config

# test_strategy's data set: a fixture, bound to its name here so that pytest finds it for this module's tests
dataset = test_strategy.dataset


# --------------------------------------------------------------------------- pure maths
def test_next_generation_keeps_the_top_half_per_code_and_refills_it_from_the_best():
    codes = ["a"] * 5 + ["b"] * 4
    votes = np.array([1.0, 9.0, 3.0, 7.0, 5.0, 0.0, 2.0, 2.0, -1.0])
    survivors, parents = next_generation(codes, votes)
    assert survivors == [1, 3, 4, 6, 7]  # a: 9, 7, 5 (ceil(5/2)); b: the tie keeps the earlier text
    assert parents == [1, 3, 6, 7]  # a needs 2 children, b needs 2; best first
    assert Counter(codes[i] for i in survivors + parents) == Counter(codes)  # every code keeps its size
    with pytest.raises(ValueError, match="votes"):
        next_generation(codes, votes[:3])


def test_preference_pairs_take_the_top_and_the_l_th_of_each_group_of_j():
    codes = ["a"] * 7 + ["b"] * 3
    scores = np.array([0.1, 0.9, 0.5, 0.3, 0.8, 0.2, 0.7, 1.0, 0.0, 0.5])
    # a: groups [0..3] and [4..6]; b: [7..9]; J = 4, l = 3
    assert preference_pairs(codes, scores, group=4, rejected_rank=3) == [(1, 3), (4, 5), (7, 8)]
    # a trailing group smaller than l gives no pair
    assert preference_pairs(codes, scores, group=4, rejected_rank=4) == [(1, 0)]
    with pytest.raises(ValueError, match="rejected rank"):
        preference_pairs(codes, scores, group=4, rejected_rank=1)


def _unit(rng, n, d=16):
    x = rng.normal(size=(n, d))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


# Every registered histogram with the pure function it computes and the sensitivity the node states.
PURE = {
    "knn-vote": (lambda *a: knn_votes(*a, 3), math.sqrt(3)),
    "nearest-neighbour": (lambda *a: knn_votes(*a, 1), 1.0),
    "contrastive-vote": (lambda *a: contrastive_votes(*a, 3), math.sqrt(6)),
    "similarity": (similarity_scores, 1.0),
    "centred-similarity": (lambda *a: similarity_scores(*a, centred=True), 1.0),
}


def test_every_registered_histogram_has_a_sensitivity_test():
    assert set(PURE) == set(HISTOGRAMS)


@pytest.mark.parametrize("name", sorted(PURE))
def test_adding_one_record_moves_a_histogram_by_at_most_its_sensitivity(name):
    fn, bound = PURE[name]
    rng = np.random.default_rng(0)
    worst = 0.0
    for trial in range(200):
        syn = _unit(rng, 12)
        syn_codes = ["a"] * 7 + ["b"] * 5
        loc = _unit(rng, 15)
        loc_codes = list(rng.choice(["a", "b"], size=15))
        # the added record: random, or a copy of a candidate (the adversary's best guess)
        extra = syn[trial % 12: trial % 12 + 1] if trial % 2 else _unit(rng, 1)
        code = syn_codes[trial % 12] if trial % 2 else str(rng.choice(["a", "b"]))
        v0 = fn(loc, loc_codes, syn, syn_codes)
        v1 = fn(np.vstack([loc, extra]), loc_codes + [code], syn, syn_codes)
        worst = max(worst, float(np.linalg.norm(v1 - v0)))
    assert worst <= bound + 1e-9
    assert worst > 0.5 * bound  # the bound is not vacuous: a record does move the histogram


def test_contrastive_votes_take_from_a_text_that_sits_among_another_codes_records():
    # Two "a" records near e0, two "b" records near e1. Text 1 is coded "a" but reads like "b";
    # kNN votes (K=1) cannot tell it from text 0; contrastive votes push it below zero.
    e = np.eye(3)
    loc = np.array([e[0], e[0], e[1], e[1]])
    loc_codes = ["a", "a", "b", "b"]
    syn = np.array([e[0], e[1], e[2], e[1]])
    syn_codes = ["a", "a", "b", "b"]
    assert knn_votes(loc, loc_codes, syn, syn_codes, 1).tolist() == [2, 0, 0, 2]
    v = contrastive_votes(loc, loc_codes, syn, syn_codes, 1)
    # "a" records: +1 to text 0, -1 to the nearest "b" text (ties: 2 and 3 are both 0 from e0;
    # the pick is one of them); "b" records: +1 to text 3, -1 to text 1 (the "a" text like "b")
    assert v[0] == 2 and v[1] == -2 and v[2] + v[3] == 0 and v.sum() == 0
    # a record whose code has no candidate still gives its -1, to a text nearest to it (1 or 3)
    only = contrastive_votes(np.array([e[1]]), ["c"], syn, syn_codes, 1)
    assert only.tolist() in ([0, -1, 0, 0], [0, 0, 0, -1])


def test_similarity_scores_clip_each_record_and_ignore_other_codes():
    syn = np.eye(4)
    scores = similarity_scores(np.array([[1.0, 1.0, 0, 0]]) / math.sqrt(2), ["a"], syn, ["a", "a", "a", "b"])
    assert scores[3] == 0.0  # another code's text gets nothing
    assert np.linalg.norm(scores) == pytest.approx(1.0)  # sims (0.71, 0.71, 0) have norm 1: unclipped
    many = similarity_scores(np.tile(syn[:1], (5, 1)), ["a"] * 5, syn, ["a"] * 4)
    assert many.tolist() == [5.0, 0.0, 0.0, 0.0]


# --------------------------------------------------------------------------- the registry
def test_one_registry_per_plug_in_point_and_one_class_path_syntax(caplog):
    """Every built-in name builds; a class path loads in the ``pkg.module:Class`` form and in
    the older dotted form (with a note giving the new one); bad names fail with the fix."""
    from flwr.serverapp.strategy import FedAvgM, FedMedian

    from common.plugins import AGGREGATORS, REFINEMENTS
    from strategies.aggregators import build_aggregator

    assert {build_refinement(n).name for n in REFINEMENTS if n != "popri"} >= {"knn-vote", "uniform", "none", "pe"}
    for name in AGGREGATORS:
        assert build_aggregator(name, 1.0, 1) is not None
        RunConfig(aggregator=name).validate()
    assert build_refinement("examples.top_voted:TopVoted").name == "top-voted"
    with caplog.at_level("INFO"):
        assert build_refinement("examples.top_voted.TopVoted").name == "top-voted"
    assert "'package.module:Class' (examples.top_voted:TopVoted)" in caplog.text
    assert isinstance(build_aggregator("flwr.serverapp.strategy:FedMedian", 1.0, 1), FedMedian)
    assert isinstance(build_aggregator("flwr.serverapp.strategy.FedMedian", 1.0, 1), FedMedian)
    assert isinstance(build_aggregator("fedavg", 0.5, 1), FedAvgM)  # eta != 1: theta + eta * Delta
    for bad, why in [("nope", "unknown"), ("examples.top_voted:Missing", "cannot load"),
                     ("strategies.resampling:sample_size", "not a subclass")]:
        with pytest.raises(ValueError, match=why):
            build_refinement(bad)
    with pytest.raises(ValueError, match="not a subclass of flwr"):
        build_aggregator("examples.top_voted:TopVoted", 1.0, 1)
    for key, bad in (("refinement", "nope"), ("aggregator", "fed avg"), ("refinement", "pkg.module:not a name")):
        with pytest.raises(ConfigError, match=f"{key}.*'package.module:Class'"):
            RunConfig(**{key: bad}).validate()
    RunConfig(refinement="examples.top_voted.TopVoted", aggregator="mypkg.mod:Strategy").validate()  # shape only
    with pytest.raises(ConfigError, match="popri-rejected-rank"):
        RunConfig(popri_samples_per_prompt=4, popri_rejected_rank=5).validate()


# --------------------------------------------------------------------------- through the strategy
def _vote_configs(grid, node=101):
    return [m.content.config_records[R.CONFIG] for m in grid.sent
            if m.metadata.message_type == R.MSG_VOTE and m.metadata.dst_node_id == node]


def _vote_releases(res, node):
    return [r for r in res.ledgers[node]["releases"] if r["phase"] == "vote"]


@pytest.mark.parametrize("method,votes_of", [("knn-vote", knn_votes), ("contrastive-vote", contrastive_votes)])
def test_a_vote_refinement_gives_its_selection_exactly(dataset, tmp_path, method, votes_of):
    """Pinned against the maths: without noise, the final set is A.4 on the exact votes of the
    weak nodes' records (kNN: the paper's; contrastive: issue 34's), and the request is one round
    of K votes at the whole epsilon_vote."""
    from common.federation import simulation_node_data
    from common.models import embed, load_embedder

    rc = run_config(dataset, epsilon="inf", refinement=method, **{"num-server-rounds": 0})
    res, grid, _ = run(rc, nodes_for(rc, 3, tmp_path))
    cfg = RunConfig.from_flower(rc)
    exact = np.zeros(len(res.pool_texts))
    emb = load_embedder(cfg.embedder)
    # compared within 2 x the generator's window, at the run's precision (bf16 where the CPU has it)
    syn = embed(emb, res.pool_texts, max_tokens=cfg.vote_window, precision=cfg.precision)
    for pid in (1, 2):  # the weak nodes
        part = simulation_node_data(cfg, pid, 3)[1]
        local = embed(emb, part.texts, max_tokens=cfg.vote_window, precision=cfg.precision)
        exact += votes_of(local, part.codes, syn, res.pool_codes, cfg.num_votes)
    assert np.array_equal(res.votes, exact)
    assert np.array_equal(res.selected, resample_by_code(res.pool_codes, exact, cfg.sampling_rate, cfg.seed))
    [conf] = _vote_configs(grid)
    assert (conf["histogram"], conf["epsilon-share"], conf["num-votes"]) == (method, 1.0, cfg.num_votes)


def test_dpo_trains_the_adapter_in_fp32_without_checkpointing_on_a_cpu_and_generation_keeps_its_cache():
    """trl's DPOConfig defaults (bf16, gradient checkpointing) made a CPU DPO step take minutes;
    the generator must come back trained, fp32, not checkpointing, and sampling with its KV cache."""
    import torch

    from common.weights import trainable_state
    from fedsyn_server.synthesis import ServerModel
    from strategies.popri import dpo_finetune

    gen = ServerModel(RunConfig(model="tiny-gpt2", max_new_tokens=4))
    before = {k: np.array(v, copy=True) for k, v in trainable_state(gen.model).items()}
    prompt = gen.prompt("topic=sport")
    stats = dpo_finetune(gen, [prompt] * 4, ["a goal in the last minute"] * 4, ["shares fell on monday"] * 4, 1e-3, 0)
    model = gen.model
    assert math.isfinite(stats.loss) and stats.steps == 2 and not model.training  # 2 epochs of one batch of 4
    assert any(not np.array_equal(before[k], v) for k, v in trainable_state(model).items())  # the adapter moved
    assert not model.is_gradient_checkpointing and next(model.parameters()).dtype == torch.float32
    assert "ref" not in getattr(model, "peft_config", {})  # trl's reference copy is gone
    calls = []
    original = model.generate
    model.generate = lambda **kw: calls.append(kw) or original(**kw)
    gen.generate({"topic=sport": 2}, seed=0)
    assert calls and all(kw["use_cache"] for kw in calls)


@pytest.mark.parametrize("method", ["pe", "pe-contrastive", "popri"])
def test_multi_round_refinements_split_epsilon_vote_across_their_rounds(dataset, tmp_path, method):
    rc = run_config(dataset, refinement=method, **{"num-server-rounds": 1, "refinement-rounds": 3,
                                                   "popri-samples-per-prompt": 3, "popri-rejected-rank": 2})
    res, grid, _ = run(rc, nodes_for(rc, 3, tmp_path))
    cfg = RunConfig.from_flower(rc)
    assert not res.failures
    assert [c["epsilon-share"] for c in _vote_configs(grid)] == pytest.approx([1 / 3] * 3)
    assert [v["round"] for v in res.vote_rounds] == [1, 2, 3]
    for weak in (101, 102):
        votes = _vote_releases(res, weak)
        assert [r["round"] for r in votes] == [1, 2, 3]
        assert sum(r["epsilon"] for r in votes) == pytest.approx(cfg.epsilon - cfg.epsilon_profile)
        # delta is split too: the rounds share the vote's part of the policy's (basic, issue 60: 6 of epsilon 8)
        assert sum(r["delta"] for r in votes) == pytest.approx(
            float(cfg.delta) * (cfg.epsilon - cfg.epsilon_profile) / cfg.epsilon)
        assert res.ledgers[weak]["epsilon-spent"] == pytest.approx(cfg.epsilon)
    # every method ends with the same final size as knn-vote would
    per_code = Counter(res.pool_codes[i] for i in res.selected)
    # refinement_rounds.jsonl: every text each round saw, its noisy score and the method's own columns
    write_outputs(tmp_path / "out", cfg, sorted(res.allocation), res)
    rows = read_jsonl(tmp_path / "out" / "refinement_rounds.jsonl")
    by_round = {t: [r for r in rows if r["round"] == t] for t in (1, 2, 3)}
    assert all(len(by_round[t]) == sum(res.allocation.values()) for t in (1, 2, 3))
    assert len(rows) == 3 * len(by_round[1])
    assert all(r["topic"] == r["control_code"].removeprefix("topic=") for r in rows)
    last = by_round[3]
    if method.startswith("pe"):
        # pe votes nearest-neighbour (sensitivity 1); pe-contrastive contrastive-vote at K = 1 (sqrt(2))
        histogram, sensitivity = ("nearest-neighbour", 1.0) if method == "pe" else ("contrastive-vote", math.sqrt(2))
        assert {(c["histogram"], c.get("num-votes", 1)) for c in _vote_configs(grid)} == {(histogram, 1)}
        assert [r["sensitivity"] for r in _vote_releases(res, 101)] == pytest.approx([sensitivity] * 3)
        assert len(res.pool_texts) == sum(res.allocation.values())
        assert all(per_code[c] == max(1, math.floor(cfg.sampling_rate * n)) for c, n in res.allocation.items() if n)
        assert len(res.refinement["rounds"]) == 3 and not res.generator_refined
        # the last round is the final population with its votes; earlier rounds say who survived
        assert [r["text"] for r in last] == res.pool_texts and [r["score"] for r in last] == pytest.approx(res.votes)
        for t in (1, 2):  # per code, the survivors out-voted the rest and open the next population
            survived = [r for r in by_round[t] if r["survived"]]
            assert {r["text"] for r in survived} == {r["text"] for r in by_round[t + 1][:len(survived)]}
            assert sum(r["children"] for r in by_round[t]) == len(by_round[t]) - len(survived)
            for code in {r["control_code"] for r in by_round[t]}:
                kept = [r["score"] for r in survived if r["control_code"] == code]
                dropped = [r["score"] for r in by_round[t] if r["control_code"] == code and not r["survived"]]
                assert kept and min(kept) >= max(dropped, default=-math.inf)
    else:
        # rounds 1 and 2 train on their pairs; round 3 is the final population, drawn from by A.4
        population = Counter(res.pool_codes)
        assert all(per_code[c] == max(1, math.floor(cfg.sampling_rate * n)) for c, n in population.items())
        assert [r["text"] for r in last] == res.pool_texts and [r["score"] for r in last] == pytest.approx(res.votes)
        assert {r["role"] for r in last} == {None} and "pairs" not in res.refinement["rounds"][2]
        trained = res.refinement["rounds"][:2]
        assert all(r["pairs"] > 0 and r["dpo_steps"] > 0 and math.isfinite(r["dpo_loss"]) for r in trained)
        assert all(r["held_out_pairs"] >= 1 and r["train_pairs"] + r["held_out_pairs"] == r["pairs"] for r in trained)
        j = cfg.popri_samples_per_prompt
        for t, note in zip((1, 2), trained):
            assert Counter(r["role"] for r in by_round[t]) == {"chosen": note["pairs"], "rejected": note["pairs"],
                                                              None: len(by_round[t]) - 2 * note["pairs"]}
            assert sum(r["held_out"] for r in by_round[t]) == 2 * note["held_out_pairs"]
            for code in {r["control_code"] for r in by_round[t]}:  # each group of J: its top text is chosen
                mine = [r for r in by_round[t] if r["control_code"] == code]
                for group in (mine[k:k + j] for k in range(0, len(mine), j)):
                    top = max(group, key=lambda r: r["score"])
                    assert top["role"] == ("chosen" if len(group) >= cfg.popri_rejected_rank else None)
        # the saved model is a kept DPO adapter, and only its adapter, exactly when a round kept one
        assert res.generator_refined == any(r["kept"] for r in trained)
        from fedsyn_server.synthesis import ServerModel

        assert list(res.arrays.keys()) == list(ServerModel(cfg).weights().keys())


class Greedy(Refinement):
    """A server that asks for more vote rounds than the budget: 3 rounds at half of epsilon_vote."""

    name = "greedy"

    def refine(self, ctx):
        from strategies.refinement import Refined

        votes = [ctx.vote(ctx.texts, ctx.codes, histogram="nearest-neighbour", epsilon_share=0.5) for _ in range(3)]
        return Refined(ctx.texts, ctx.codes, np.arange(len(ctx.texts)), votes[-1])


def test_vote_rounds_beyond_epsilon_vote_are_refused_by_every_node(dataset, tmp_path):
    rc = run_config(dataset, refinement="tests.test_refinement:Greedy", **{"num-server-rounds": 0})
    res, _, _ = run(rc, nodes_for(rc, 3, tmp_path))
    refused = {(f["node_id"], f["phase"]) for f in res.failures if "refused" in f["reason"]}
    assert refused == {(101, "vote"), (102, "vote")}  # the third round, on each weak node
    for weak in (101, 102):
        assert [r["round"] for r in _vote_releases(res, weak)] == [1, 2]
        assert res.ledgers[weak]["epsilon-spent"] == pytest.approx(8.0)
        assert sum(r["delta"] for r in _vote_releases(res, weak)) == pytest.approx(1e-5 * 6 / 8)
    assert not res.node_votes and not res.votes.any()  # the refused round adds nothing


def test_the_docs_example_runs_end_to_end(dataset, tmp_path):
    rc = run_config(dataset, refinement="examples.top_voted:TopVoted", **{"num-server-rounds": 0})
    res, grid, _ = run(rc, nodes_for(rc, 3, tmp_path))
    assert not res.failures and len(res.vote_rounds) == 1
    for code, n in res.allocation.items():
        kept = [i for i in res.selected if res.pool_codes[i] == code]
        assert len(kept) == max(1, math.floor(RunConfig().sampling_rate * n)) if n else not kept
        others = [res.votes[i] for i in range(len(res.pool_codes)) if res.pool_codes[i] == code and i not in kept]
        assert all(res.votes[i] >= max(others, default=-math.inf) for i in kept)  # the top-voted per code


def test_grpo_masks_the_servers_column_names_out_of_a_rows_completion():
    """GRPO reinforces only the tokens the model chose: in a table row, the values."""
    from common.models import load_generator
    from common.rows import schema_from_dict
    from strategies.grpo import group_counts, masked_completion

    _, tok = load_generator("tiny-gpt2", seed=0)
    schema = schema_from_dict({"columns": [{"name": "x", "type": "integer", "min": 0, "max": 99},
                                           {"name": "z", "type": "float", "min": 0, "max": 5, "decimals": 1}]})
    ids, mask = masked_completion("z is 1.5, x is 42", tok, schema)
    chosen = tok.decode([i for i, m in zip(ids, mask) if m])
    written = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert chosen.split() == ["1.5", "42"] and written.split() == ["z", "is,", "x", "is"]
    assert tok.decode(ids) == "z is 1.5, x is 42"
    free, free_mask = masked_completion("a goal in the last minute", tok, None)
    assert tok.decode(free) == "a goal in the last minute" and all(free_mask)
    assert group_counts({"a": 45, "b": 75, "c": 0, "d": 1}, 8) == {"a": 6, "b": 9, "d": 1}


def test_grpo_learns_from_the_dp_votes_alone_one_round_each(dataset, tmp_path):
    """``refinement = "grpo"`` through the strategy with the real ClientApp: trl's reward is one
    centred-similarity vote round per training round, at epsilon_vote / T on every voter; the adapter
    moves and is what the run saves; the last round scores the trained generator's population and
    A.4 draws the common final size from it."""
    rc = run_config(dataset, refinement="grpo", **{"num-server-rounds": 1, "refinement-rounds": 3,
                                                   "grpo-group-size": 4})
    res, grid, _ = run(rc, nodes_for(rc, 3, tmp_path))
    cfg = RunConfig.from_flower(rc)
    assert not res.failures
    assert [(c["histogram"], c["epsilon-share"]) for c in _vote_configs(grid)] == [("centred-similarity",
                                                                                    pytest.approx(1 / 3))] * 3
    for weak in (101, 102):
        assert [r["round"] for r in _vote_releases(res, weak)] == [1, 2, 3]
        assert res.ledgers[weak]["epsilon-spent"] == pytest.approx(cfg.epsilon)
    rounds = res.refinement["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3] and all(r["texts"] > 0 for r in rounds)
    assert all(math.isfinite(r["train_loss"]) and r["steps"] > 0 for r in rounds[:2])
    assert res.generator_refined
    per_code = Counter(res.pool_codes[i] for i in res.selected)
    assert all(per_code[c] == max(1, math.floor(cfg.sampling_rate * n)) for c, n in Counter(res.pool_codes).items())


# --------------------------------------------------------------------------- vote plans (no Flower)
class _Recorder:
    """A ``ctx.vote`` that records each round's request and answers with ones."""

    def __init__(self) -> None:
        self.requests: list[dict] = []

    def __call__(self, texts, codes, histogram="knn-vote", epsilon_share=1.0, **params):
        self.requests.append({"histogram": histogram, "epsilon_share": epsilon_share, **params})
        return np.ones(len(texts))


class _Writer:
    """A generator whose variation of a text is the text with a mark (PE's children)."""

    def variation(self, texts, codes, seed):
        return [t + "'" for t in texts]


@pytest.mark.parametrize("method", ["knn-vote", "contrastive-vote", "pe", "pe-contrastive"])
def test_a_refinement_asks_exactly_the_votes_its_plan_declares(method):
    from strategies.refinement import RefinementContext

    cfg = RunConfig(refinement=method, num_votes=3, refinement_rounds=3)
    vote = _Recorder()
    codes = ["a", "b"] * 4
    ctx = RefinementContext(cfg=cfg, texts=[f"t{i}" for i in range(8)], codes=codes, allocation={"a": 4, "b": 4},
                            profile=np.array([4.0, 4.0]), vocabulary=["a", "b"], generator=_Writer(), vote=vote,
                            rng=np.random.default_rng(0), writers=["finetuned"] * 8)
    refinement = build_refinement(method)
    refinement.refine(ctx)
    plan = refinement.vote_plan(cfg)
    assert vote.requests == [plan.request()] * plan.rounds  # the plan fedsyn plan and the report read
    assert plan.rounds == (3 if method.startswith("pe") else 1)
    assert sum(r["epsilon_share"] for r in vote.requests) == pytest.approx(1.0)


def test_the_plan_and_the_nodes_read_one_sensitivity_per_histogram():
    from common import histograms
    from common.data import TextData
    from fedsyn_client.histograms import vote_histogram
    from strategies.refinement import planned_votes

    params = {"num-votes": 3}
    expected = {"knn-vote": math.sqrt(3), "contrastive-vote": math.sqrt(6), "nearest-neighbour": 1.0, "similarity": 1.0,
                "centred-similarity": 1.0}
    records = TextData(["x"], ["a"])
    for name, value in expected.items():
        assert histograms.sensitivity(name, params) == pytest.approx(value)
        # the node's builder (nothing is computed until after the reservation) states the same bound
        assert vote_histogram(name, records, ["y"], ["a"], params, RunConfig())[1] == pytest.approx(value)
        assert histograms.histogram(name).sensitivity(params) == pytest.approx(value)
    assert set(expected) == set(HISTOGRAMS)  # one registry: the plan and the nodes read the same objects
    with pytest.raises(ConfigError, match="not registered"):
        histograms.sensitivity("a-plug-in's", params)
    assert planned_votes(RunConfig(refinement="pe-contrastive", refinement_rounds=4)) == (
        4, pytest.approx(math.sqrt(2)), "sqrt(2K)")
    assert planned_votes(RunConfig(refinement="uniform")) is None
    assert planned_votes(RunConfig(refinement="tests.test_refinement:Greedy")) is None  # declares no plan
