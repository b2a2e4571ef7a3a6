"""``fedsyn audit`` (issue 63): the Gaussian claim's maths, the neighbours it writes, and the audit
of the node's real release path, correct and with each planted bug it must catch (sigma halved, a
stated sensitivity half the real one, a view that swaps a record on add)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from common.auditing import gaussian_epsilon, shape_check, sigma_upper
from common.dp import analytic_gaussian_sigma

# ------------------------------------------------------------------------------ the maths


def test_sigma_upper_covers_sigma_at_its_confidence():
    rng = np.random.default_rng(0)
    misses = sum(sigma_upper(rng.normal(0, 2.0, 500), 0.9) < 2.0 for _ in range(2000))
    assert 0.08 < misses / 2000 < 0.12  # one-sided 10%
    assert sigma_upper(rng.normal(0, 2.0, 20000), 0.999) == pytest.approx(2.0, rel=0.04)


def test_sigma_upper_refuses_bad_input():
    for bad in (np.array([]), np.array([1.0, np.nan])):
        with pytest.raises(ValueError, match="finite"):
            sigma_upper(bad, 0.9)
    with pytest.raises(ValueError, match="confidence"):
        sigma_upper(np.ones(3), 1.0)


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 2.0, 6.0])
def test_gaussian_epsilon_inverts_the_calibration(epsilon):
    sigma = analytic_gaussian_sigma(epsilon, 1e-5, 3.0)
    assert gaussian_epsilon(sigma, 3.0, 1e-5) == pytest.approx(epsilon, rel=1e-3)
    assert gaussian_epsilon(sigma / 2, 3.0, 1e-5) > 1.8 * epsilon  # half the noise: about twice the loss
    assert gaussian_epsilon(sigma, 0.0, 1e-5) == 0.0 and gaussian_epsilon(0.0, 1.0, 1e-5) == math.inf


def test_shape_check_passes_the_gaussian_and_rejects_what_is_not():
    rng = np.random.default_rng(1)
    ok = shape_check(rng.normal(0, 2, (300, 5)), rng.normal(0, 2, (300, 5)))
    assert min(ok.normal_p, ok.mean_p, ok.same_sigma_p) > 1e-3 and ok.failures(1e-4) == []
    laplace = shape_check(rng.laplace(0, 2, 3000), rng.laplace(0, 2, 3000))
    assert any("not normal" in f for f in laplace.failures(1e-4))
    biased = shape_check(rng.normal(0.5, 2, 3000), rng.normal(0.5, 2, 3000))
    assert any("not centred" in f for f in biased.failures(1e-4))
    scaled = shape_check(rng.normal(0, 2, 3000), rng.normal(0, 2.4, 3000))  # noise scaled by the records
    assert any("scale differs" in f for f in scaled.failures(1e-4))
    assert shape_check(np.zeros(4), np.zeros(4)).failures(1e-4) == []


# ------------------------------------------------------------------------------ the neighbours


@pytest.mark.parametrize("suffix", [".csv", ".csv.bz2", ".jsonl", ".jsonl.gz", ".jsonl.xz", ".parquet"])
def test_neighbours_differ_in_one_record_each_value_as_written(tmp_path, suffix):
    from fedsyn_client.privacy_audit import neighbours, read_rows

    frame = pd.DataFrame({"text": [f"record {i}" for i in range(30)], "topic": ["01", "x", "y"] * 10,
                          "size": list(range(30))})
    path = tmp_path / f"site{suffix}"
    if ".csv" in suffix:
        frame.to_csv(path, index=False, compression="infer")
    elif suffix == ".parquet":
        frame.to_parquet(path)
    else:
        frame.to_json(path, orient="records", lines=True, compression="infer")
    source = read_rows(path)
    pairs = neighbours(source, tmp_path / "n", bound=20)
    assert {p.name.split(":")[0] for p in pairs} == {"below max-records (10)", "at max-records (20)",
                                                    "above max-records (27)"}
    for pair in pairs:
        d, other = read_rows(pair.d).rows, read_rows(pair.d_prime).rows
        assert pair.d.name.endswith(suffix) and abs(len(d) - len(other)) == 1
        key = [tuple(sorted((k, str(v)) for k, v in r.items())) for r in d]
        key_other = [tuple(sorted((k, str(v)) for k, v in r.items())) for r in other]
        big, small = (key, key_other) if len(d) > len(other) else (key_other, key)
        for row in small:
            big.remove(row)  # every record of the smaller file is in the larger, value for value
        assert len(big) == 1
    assert read_rows(pairs[0].d).rows[0]["topic"] == "01"  # a CSV's text stays its text


def test_a_json_array_is_read_and_its_neighbours_written_as_json_lines(tmp_path):
    from fedsyn_client.privacy_audit import neighbours, read_rows

    path = tmp_path / "site.json"
    pd.DataFrame({"text": [f"r {i}" for i in range(6)], "topic": ["x", "y"] * 3}).to_json(path, orient="records")
    source = read_rows(path)
    assert len(source.rows) == 6 and source.suffix == ".jsonl"
    assert all(p.d_prime.name.endswith(".jsonl") for p in neighbours(source, tmp_path / "n", bound=4))
    assert len(read_rows(path, limit=4).rows) == 4


def test_a_table_gets_records_at_its_columns_edges(tmp_path):
    from common.rows import load_schema
    from fedsyn_client.privacy_audit import neighbours, read_rows

    schema = load_schema('{"columns": [{"name": "topic", "type": "categorical", "categories": ["x", "y"]}, '
                         '{"name": "size", "type": "integer", "min": 0, "max": 99}]}')
    path = tmp_path / "t.csv"
    pd.DataFrame({"topic": ["x", "y"] * 5, "size": range(10)}).to_csv(path, index=False)
    pairs = neighbours(read_rows(path), tmp_path / "n", bound=8, schema=schema)
    edges = [read_rows(p.d_prime).rows[-1] for p in pairs if "column's max" in p.name]
    assert edges and all(r == {"topic": "y", "size": "99"} for r in edges)


def test_an_empty_file_is_refused(tmp_path):
    from fedsyn_client.privacy_audit import RowFile, neighbours

    with pytest.raises(ValueError, match="no records"):
        neighbours(RowFile([], ".csv", ["text"]), tmp_path, 10)


# --------------------------------------------------------------------------- the node, for real
@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A weak node's CSV of 60 news records, five topics, and its node config."""
    from common.tables import load_table

    folder = tmp_path_factory.mktemp("site")
    frame = load_table("bbc-news")[["text", "topic"]].sample(60, random_state=0)
    frame.to_csv(folder / "site.csv", index=False)
    return {"tier": "weak", "data-path": str(folder / "site.csv"), "max-records": 1000,
            "state-dir": str(folder / "state"), "epsilon": 8.0}


def _audit(site, capsys, *release: str, fast: bool = True, sums: bool = False) -> tuple[int, str]:
    """``fedsyn audit`` on ``site`` (the releases named, or all; ``fast``: at max-records 40 and 60 draws,
    else at its defaults; ``sums``: ``--sum``): (exit code, what it printed)."""
    from fedsyn_server.cli import main

    config = " ".join(f'{k}="{v}"' if isinstance(v, str) else f"{k}={v}" for k, v in site.items())
    code = main(["audit", "--node-config", config, *(["--max-records", "40", "--draws", "60"] if fast else []),
                 *(["--sum"] if sums else []), *[a for r in release for a in ("--release", r)]])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_the_audit_passes_the_node_as_built(site, capsys, monkeypatch, tmp_path):
    """At its default settings, every release a weak node serves in the default run."""
    from fedsyn_client.audit import AUDIT_ENV

    monkeypatch.setenv(AUDIT_ENV, str(tmp_path / "live-log"))  # the operator's outgoing-message log
    code, text = _audit(site, capsys, fast=False)
    assert not (tmp_path / "live-log").exists()  # the audit's replies never left the node: not logged there
    assert code == 0, text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("profile", "vote:"))}
    assert set(rows) == {"profile", "vote:knn-vote", "vote:contrastive-vote", "vote:nearest-neighbour",
                         "vote:similarity", "vote:centred-similarity"}
    stated, lower = float(rows["profile"][1]), float(rows["profile"][2])
    assert 0 < lower <= stated  # the bound is informative and below the statement
    assert rows["profile"][-1] == "ok" and "1/1" in " ".join(rows["profile"])  # the measured sensitivity is 1
    assert not Path(site["state-dir"]).exists()  # the node's own state (its ledger) is never opened


def test_halved_noise_is_caught(site, capsys, monkeypatch):
    from common import dp
    from fedsyn_client import release

    monkeypatch.setattr(release, "gaussian_release", lambda v, sigma, rng: dp.gaussian_release(v, sigma / 2, rng))
    code, text = _audit(site, capsys, "profile")
    assert code == 1 and "profile FAILS: it loses epsilon" in text and "FAILED: profile" in text


def test_a_stated_sensitivity_half_the_real_one_is_caught(site, capsys, monkeypatch):
    from fedsyn_client import client_app
    from fedsyn_client.release import GaussianHistogram

    class HalfSensitivity(GaussianHistogram):
        def __init__(self, histogram, compute, sensitivity, prepare=None):
            super().__init__(histogram, compute, sensitivity / 2, prepare)

    monkeypatch.setattr(client_app, "GaussianHistogram", HalfSensitivity)
    code, text = _audit(site, capsys, "profile")
    assert code == 1 and "its sensitivity is at least 1, above the stated 0.5" in text


def test_a_view_that_swaps_a_record_on_add_is_found_unaided(site, capsys, monkeypatch):
    """Issue 60's old view: a file above the bound cut to a uniform subsample of exactly the bound,
    so a record added at the bound pushes another out. Nothing tells the audit where to look."""
    from fedsyn_client import node

    def subsample(data, bound, seed):
        if len(data) <= bound:
            return data
        keep = np.random.default_rng(seed % 2 ** 32).permutation(len(data))[:bound]
        return data.subset(sorted(int(i) for i in keep))

    monkeypatch.setattr(node, "bounded", subsample)
    code, text = _audit(site, capsys, "profile")
    assert code == 1 and "profile FAILS: its sensitivity is at least" in text
    assert "max-records (40): add" in text or "max-records (54)" in text  # found at or above the bound


def test_bad_node_configs_are_refused_before_anything_runs(tmp_path, capsys):
    from fedsyn_server.cli import main

    assert main(["audit", "--node-config", 'partition-id=0 num-partitions=2']) == 1
    assert "simulated" in capsys.readouterr().err
    assert main(["audit", "--node-config", f'tier="weak" data-path="{tmp_path}/none.csv" max-records=10 '
                                           f'state-dir="{tmp_path}" epsilon=8.0']) == 1
    assert "none.csv" in capsys.readouterr().err
    assert main(["audit", "--node-config", 'tier="weak" epsilon=8.0']) == 1  # no data-path, no max-records
    err = capsys.readouterr().err
    assert "data-path" in err or "max-records" in err
