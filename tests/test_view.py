"""Issue 45: a deployed node reads its file once, into a snapshot whose size is the bound's.

Reading a CSV takes time that grows with it; the server sees each reply's ClientApp time. The
node keeps its view (at most ``max-records`` records, each cut to a public number of bytes) in its
state folder as ``bound`` fixed rows, and every request reads all of them.
"""

from __future__ import annotations

import os

import pandas as pd
import pytest

from common.data import TextData
from fedsyn_client import node as node_module
from fedsyn_client.policy import policy_from_node_config
from fedsyn_client.view import CODE_BYTES, bounded, cut_view, read_snapshot, view_seed, write_snapshot

STAMP = {"data-path": "/data/x.csv", "size": 10, "mtime-ns": 1}


def test_a_snapshot_holds_the_records_in_rows_of_fixed_size(tmp_path):
    data = TextData(["short", "añadido " * 100, ""], ["topic=a", "topic=ẋ", "topic=b"])
    view = cut_view(data, 64)
    assert view.texts[0] == "short" and len(view.texts[1].encode()) <= 64 and view.texts[1].startswith("añadido")
    sizes = []
    for n in (1, 3):
        path = tmp_path / f"v{n}.bin"
        write_snapshot(path, view.subset(range(n)), 5, 64, STAMP)
        got, fingerprint = read_snapshot(path, STAMP)
        assert got.texts == view.texts[:n] and got.codes == view.codes[:n] and len(fingerprint) == 64
        assert (os.stat(path).st_mode & 0o777) == 0o600
        sizes.append(len(path.read_bytes().partition(b"\n")[2]))
    assert sizes == [5 * (8 + 64 + CODE_BYTES)] * 2  # the body is the bound's, whatever it holds
    assert read_snapshot(tmp_path / "v3.bin", {**STAMP, "size": 11}) is None  # the file changed: stale
    assert read_snapshot(tmp_path / "missing.bin", STAMP) is None
    (tmp_path / "v3.bin").write_bytes((tmp_path / "v3.bin").read_bytes()[:-1])
    assert read_snapshot(tmp_path / "v3.bin", STAMP) is None  # damaged: built again
    assert cut_view(TextData(["t"], ["topic=" + "z" * 300]), 64).codes == [""]  # in no vocabulary
    with pytest.raises(ValueError, match="above the bound"):
        write_snapshot(tmp_path / "x.bin", view, 2, 64, STAMP)


def test_a_node_reads_its_file_once_and_again_only_when_it_changes(tmp_path, monkeypatch):
    path = tmp_path / "d.csv"
    pd.DataFrame({"text": [f"record {i}" for i in range(30)], "topic": ["x"] * 30}).to_csv(path, index=False)
    config = {"tier": "weak", "data-path": str(path), "epsilon": 3.0, "state-dir": str(tmp_path / "s"),
              "max-records": 20, "control-columns": "topic"}
    policy = policy_from_node_config(config)
    reads = []
    real = node_module.load_node_data
    monkeypatch.setattr(node_module, "load_node_data", lambda *a, **k: reads.append(1) or real(*a, **k))
    first = node_module._view(policy, str(tmp_path / "s"))[0]
    again = node_module._view(policy, str(tmp_path / "s"))[0]
    assert len(reads) == 1 and first == again and 0 < len(first) <= 20  # one record of each odd slot of 20, kept
    whole = TextData([f"record {i}" for i in range(30)], ["topic=x"] * 30)
    assert first == bounded(whole, 20, view_seed(tmp_path / "s"))
    assert len(list((tmp_path / "s").glob("view-*.bin"))) == 1
    pd.DataFrame({"text": ["a new one"], "topic": ["x"]}).to_csv(path, index=False)
    os.utime(path, ns=(1, 1))
    assert node_module._view(policy, str(tmp_path / "s"))[0].texts == ["a new one"] and len(reads) == 2


def test_a_nodes_views_and_counts_look_at_every_slot_and_padding_counts_for_nothing(tmp_path, monkeypatch):
    import numpy as np

    from fedsyn_client.node import Node

    policy = policy_from_node_config({"tier": "weak", "data-path": str(tmp_path / "d.csv"), "epsilon": 3.0,
                                      "max-records": 10})
    node = Node(policy, TextData(["a", "b", "c", "d"], ["topic=x", "topic=y", "topic=x", ""]), None, None)
    looked = []
    fromiter = np.fromiter
    monkeypatch.setattr(np, "fromiter", lambda it, dtype, count: looked.append(count) or fromiter(it, dtype, count))
    # a vocabulary holding "" (a padding slot's code) still counts only records
    vocabulary = ("topic=x", "", "topic=z")
    assert node.code_counts(vocabulary).tolist() == [2, 1, 0]
    assert node.records(vocabulary).texts == ["a", "c", "d"]
    assert looked == [10]  # the bound's slots, not the 4 records, once per vocabulary
    assert node.records(("topic=y",)).codes == ["topic=y"]
