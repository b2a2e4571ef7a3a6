"""The MST baseline (``benchmarks/baselines/mst.py``): its pure steps, and one real run on mbi."""

from __future__ import annotations

import datetime as dt
import itertools

import numpy as np
import pandas as pd
import pytest

from benchmarks.baselines import mst as M
from common import dp, marginals as Mg
from common.rows import schema_from_dict

SCHEMA = schema_from_dict({"columns": [
    {"name": "y", "type": "categorical", "categories": ["a", "b", "c"]},
    {"name": "x", "type": "integer", "min": 0, "max": 100},
    {"name": "few", "type": "integer", "min": 1, "max": 5},
    {"name": "z", "type": "float", "min": 0, "max": 10, "decimals": 2},
    {"name": "day", "type": "date", "min": "2024-01-01", "max": "2024-12-31"},
]})


def _records(n: int, seed: int, lo: float = 0.0, hi: float = 1.0) -> pd.DataFrame:
    """Records whose numbers and dates fill the fraction [lo, hi] of each declared range."""
    rng = np.random.default_rng(seed)
    u = lambda: lo + (hi - lo) * rng.uniform(size=n)  # noqa: E731
    return pd.DataFrame({
        "y": rng.choice(["a", "b", "c"], n),
        "x": np.round(u() * 100).astype(np.int64),
        "few": 1 + np.round(u() * 4).astype(np.int64),
        "z": np.round(u() * 10, 2),
        "day": [dt.date(2024, 1, 1) + dt.timedelta(days=int(round(v * 365))) for v in u()],
    })


# --- privacy conversion --------------------------------------------------------------------------

def test_cdp_rho_matches_the_reference_implementation():
    # private-pgm mechanisms/cdp2adp.py: cdp_rho(1.0, 1e-9), cdp_rho(8.0, 1e-5), cdp_rho(50.0, 1e-5)
    assert dp.cdp_rho(1.0, 1e-9) == pytest.approx(0.014973057673588523, rel=1e-12)
    assert dp.cdp_rho(8.0, 1e-5) == pytest.approx(1.229714525761431, rel=1e-12)
    assert dp.cdp_rho(50.0, 1e-5) == pytest.approx(20.718340470824234, rel=1e-12)
    rho = dp.cdp_rho(1.0, 1e-6)
    assert dp.cdp_delta(rho, 1.0) <= 1e-6 < dp.cdp_delta(rho * 1.001, 1.0)
    assert dp.cdp_rho(1.0, 1.0) == 0.0


# --- discretisation ------------------------------------------------------------------------------

def test_bin_edges_come_from_the_declared_range():
    assert np.allclose(Mg.bin_edges(SCHEMA.column("z"), 16), np.linspace(0, 10, 17))
    # integers: 101 whole values, each owning [v, v + 1), in 16 equal-width bins
    assert np.allclose(Mg.bin_edges(SCHEMA.column("x"), 16), np.arange(17) * 101 / 16)
    # a range of fewer whole values than bins: one bin per value
    assert Mg.domain_size(SCHEMA.column("few"), 16) == 5
    assert np.allclose(Mg.bin_edges(SCHEMA.column("few"), 16), np.arange(1, 7))
    first = dt.date(2024, 1, 1).toordinal()
    assert np.allclose(Mg.bin_edges(SCHEMA.column("day"), 16), first + np.arange(17) * 366 / 16)
    assert Mg.domain_size(SCHEMA.column("y"), 16) == 3


def test_bins_do_not_move_when_the_data_range_changes():
    narrow, wide = _records(200, 0, 0.4, 0.6), _records(200, 1, 0.0, 1.0)
    both = pd.concat([narrow, wide], ignore_index=True)
    # the narrow records' codes are the same alone and next to records spanning the whole range
    assert Mg.discretise(narrow, SCHEMA, 16).equals(Mg.discretise(both, SCHEMA, 16).iloc[:200])
    codes = Mg.discretise(narrow, SCHEMA, 16)
    # values in the middle fifth of the declared range fill only the middle bins, not all 16
    assert codes["x"].min() >= 6 and codes["x"].max() <= 9
    assert codes["z"].min() >= 6 and codes["z"].max() <= 9
    # fixed points: the declared ends fall in the edge bins, 50 in the eighth (50 * 16 // 101)
    edge = pd.DataFrame({"y": ["a"] * 3, "x": [0, 50, 100], "few": [1, 3, 5], "z": [0.0, 5.0, 10.0],
                         "day": [dt.date(2024, 1, 1), dt.date(2024, 7, 1), dt.date(2024, 12, 31)]})
    coded = Mg.discretise(edge, SCHEMA, 16)
    assert coded["x"].tolist() == [0, 7, 15] and coded["z"].tolist() == [0, 8, 15]
    assert coded["few"].tolist() == [0, 2, 4] and coded["day"].tolist() == [0, 7, 15]


def test_discretise_then_undiscretise_round_trips_every_column_type():
    records = _records(300, 2)
    codes = Mg.discretise(records, SCHEMA, 16)
    assert list(codes.columns) == list(SCHEMA.names) and len(codes) == 300
    back = Mg.undiscretise(codes, SCHEMA, 16, np.random.default_rng(0))
    assert list(back.columns) == list(SCHEMA.names)
    # each value is drawn inside its bin: coding it again gives the same bin
    assert Mg.discretise(back, SCHEMA, 16).equals(codes)
    assert back["y"].tolist() == records["y"].tolist()  # categories come back exactly
    assert back["few"].tolist() == records["few"].tolist()  # one bin per value: exact too
    assert back["x"].dtype == np.int64 and back["z"].dtype == np.float64
    assert all(isinstance(v, dt.date) for v in back["day"])
    assert np.allclose(back["z"], np.round(back["z"], 2))
    for column in SCHEMA.columns:  # every value is one the schema accepts
        for value in back[column.name]:
            column.write(value)
    # the draw is uniform inside a bin: x's values in bin 0 (whole values 0..6) are not all one
    many = Mg.undiscretise(pd.DataFrame({n: np.zeros(500, dtype=np.int64) for n in SCHEMA.names}), SCHEMA, 16,
                          np.random.default_rng(1))
    assert set(many["x"]) == set(range(7))
    assert 0.0 <= many["z"].min() and many["z"].max() <= 0.63 and many["z"].nunique() > 30


def test_discretise_drops_undeclared_categories_and_clips_numbers_into_the_edge_bins():
    records = pd.DataFrame({"y": ["a", "zzz", "b", "c"], "x": [-50, 3, 1000, np.nan], "few": [1, 1, 1, 1],
                            "z": [99.0, 1.0, -3.0, 1.0],
                            "day": ["1999-01-01", "2024-02-02", "2030-01-01", "2024-03-03"]})
    codes = Mg.discretise(records, SCHEMA, 16)
    # "zzz" is not declared, NaN is not a number: both rows are dropped before anything is counted
    assert len(codes) == 2
    assert codes["x"].tolist() == [0, 15] and codes["z"].tolist() == [15, 0] and codes["day"].tolist() == [0, 15]


def test_dates_as_python_dates_or_pandas_datetimes_code_the_same():
    records = _records(50, 3)
    as_pandas = records.assign(day=pd.to_datetime(records["day"]))
    assert as_pandas["day"].dtype.kind == "M"
    assert Mg.discretise(records, SCHEMA, 16).equals(Mg.discretise(as_pandas, SCHEMA, 16))


def test_a_number_without_a_declared_range_is_refused():
    schema = schema_from_dict({"columns": [{"name": "y", "type": "categorical", "categories": ["a"]},
                                           {"name": "w", "type": "float", "min": 0}]})
    frame = pd.DataFrame({"y": ["a"], "w": [1.0]})
    with pytest.raises(ValueError, match="need declared ranges"):
        Mg.discretise(frame, schema, 16)
    with pytest.raises(ValueError, match="need declared ranges"):
        M.mst_synthesise(frame, schema, 1.0, 1e-5, 10, seed=0)


# --- the private steps ---------------------------------------------------------------------------

def _is_spanning_tree(edges: list[tuple[str, str]], attrs: list[str]) -> bool:
    parent = {a: a for a in attrs}

    def root(a: str) -> str:
        while parent[a] != a:
            a = parent[a]
        return a

    for a, b in edges:
        ra, rb = root(a), root(b)
        if ra == rb:
            return False  # a cycle
        parent[ra] = rb
    # n - 1 edges without a cycle join all n attributes
    return len(edges) == len(attrs) - 1 and len({root(a) for a in attrs}) == 1


def test_tree_selection_returns_a_spanning_tree_and_the_maximum_one_at_a_huge_rho():
    import networkx as nx

    attrs = [f"c{i}" for i in range(7)]
    rng = np.random.default_rng(0)
    weights = {e: float(w) for e, w in zip(itertools.combinations(attrs, 2), rng.permutation(21) * 3.0 + 1)}
    for seed in range(5):
        tree = M.select_tree(weights, attrs, rho=0.01, rng=np.random.default_rng(seed))
        assert _is_spanning_tree(tree, attrs)
    graph = nx.Graph()
    graph.add_weighted_edges_from((a, b, w) for (a, b), w in weights.items())
    best = {frozenset(e) for e in nx.maximum_spanning_tree(graph).edges}
    tree = M.select_tree(weights, attrs, rho=1e9, rng=np.random.default_rng(0))
    assert _is_spanning_tree(tree, attrs) and {frozenset(e) for e in tree} == best
    # weights keyed the other way round are read the same
    flipped = {(b, a): w for (a, b), w in weights.items()}
    assert {frozenset(e) for e in M.select_tree(flipped, attrs, 1e9, np.random.default_rng(0))} == best
    assert M.select_tree({}, ["only"], 1.0, np.random.default_rng(0)) == []


def test_compression_merges_the_values_below_the_threshold_and_decompression_draws_among_them():
    mapping = M.support_mapping(np.array([10.0, 1.0, 20.0, -3.0]), threshold=5.0)
    assert mapping.tolist() == [0, 2, 1, 2]
    back = M.decompress(np.array([0, 1] + [2] * 200), mapping, np.random.default_rng(0))
    assert back[:2].tolist() == [0, 2] and set(back[2:]) == {1, 3}


# --- one real run --------------------------------------------------------------------------------

E2E_SCHEMA = schema_from_dict({"columns": [
    {"name": "y", "type": "categorical", "categories": ["a", "b"]},
    {"name": "x", "type": "integer", "min": 0, "max": 100},
    {"name": "z", "type": "float", "min": 0, "max": 10, "decimals": 1},
    {"name": "day", "type": "date", "min": "2024-01-01", "max": "2024-03-31"},
]})


def _dependent_records(n: int = 400) -> pd.DataFrame:
    rng = np.random.default_rng(11)
    y = rng.choice(["a", "b"], n)
    return pd.DataFrame({
        "y": y,
        "x": np.where(y == "a", rng.integers(70, 101, n), rng.integers(0, 31, n)),  # x high iff y == "a"
        "z": np.round(rng.uniform(0, 10, n), 1),  # independent of both
        "day": [dt.date(2024, 1, 1) + dt.timedelta(days=int(k)) for k in rng.integers(0, 91, n)],
    })


@pytest.fixture(scope="module")
def mst_run():
    # its time is a benchmark's concern (benchmarks/README.md), not this test's
    real = _dependent_records()
    return real, M.mst_synthesise(real, E2E_SCHEMA, epsilon=50.0, delta=1e-5, rows=400, seed=7)


def test_mst_keeps_the_dependence_and_stays_inside_the_schema(mst_run):
    real, syn = mst_run
    assert list(syn.columns) == list(E2E_SCHEMA.names) and len(syn) == 400
    means = syn.groupby("y")["x"].mean()
    assert means["a"] > means["b"] + 30, means  # real: about 85 against 15
    assert (syn.loc[syn.y == "a", "x"] >= 60).mean() > 0.8 and (syn.loc[syn.y == "b", "x"] <= 40).mean() > 0.8
    for column in E2E_SCHEMA.columns:
        for value in syn[column.name]:
            column.write(value)  # raises for an undeclared category or a value out of range
    assert syn["x"].dtype == np.int64 and syn["z"].dtype == np.float64
    assert syn["y"].dtype == real["y"].dtype and all(isinstance(v, dt.date) for v in syn["day"])
    assert np.allclose(syn["z"], np.round(syn["z"], 1))
    assert 3 < syn["z"].mean() < 7 and syn["day"].nunique() > 20  # the bins' values are spread out


def test_mst_is_reproducible_from_its_seed(mst_run):
    real, first = mst_run
    again = M.mst_synthesise(real, E2E_SCHEMA, epsilon=50.0, delta=1e-5, rows=400, seed=7)
    pd.testing.assert_frame_equal(first, again)
    # pandas datetimes in, pandas datetimes out; the same records otherwise
    as_pandas = M.mst_synthesise(real.assign(day=pd.to_datetime(real["day"])), E2E_SCHEMA, epsilon=50.0,
                                 delta=1e-5, rows=400, seed=7)
    assert as_pandas["day"].dtype == pd.to_datetime(real["day"]).dtype
    pd.testing.assert_frame_equal(as_pandas.assign(day=as_pandas["day"].dt.date), first)
    other = M.mst_synthesise(real, E2E_SCHEMA, epsilon=50.0, delta=1e-5, rows=400, seed=8)
    assert not other.equals(first)
