"""Whether two runs' privacy reports hold the same ledgers, statements and sigmas, bit for bit.

Usage: python -m benchmarks.ledger_compare BEFORE/privacy_report.json AFTER/privacy_report.json
Run ids, node ids, ledger refs and times differ between any two runs and are left out; every other
field of every node's entry and release (epsilon, delta, sigma, sensitivity, the rule's terms,
status) must be equal as JSON values. The DP noise is unseeded, so the released vectors and texts
differ; what a node states and books does not (issue 62's "no behaviour change").
"""

from __future__ import annotations

import json
import sys
from typing import Any

VOLATILE = {"run_id", "node_id", "node_ids", "ledger_ref", "time", "id", "reason"}


def clean(x: Any) -> Any:
    """``x`` without the fields that differ between any two runs, keys sorted."""
    if isinstance(x, dict):
        return {k: clean(v) for k, v in sorted(x.items()) if k not in VOLATILE}
    if isinstance(x, list):
        return [clean(v) for v in x]
    return x


def main(before: str, after: str) -> int:
    """Print whether the two reports agree; 0 when they do, 1 when not."""
    a, b = (json.loads(open(p).read()) for p in (before, after))
    na = sorted((clean(n) for n in a["nodes"]), key=lambda n: (n["tier"], json.dumps(n)))
    nb = sorted((clean(n) for n in b["nodes"]), key=lambda n: (n["tier"], json.dumps(n)))
    same = na == nb
    print("nodes (ledgers, statements, sigma) identical:", same, "| releases:", sum(len(n["releases"]) for n in na))
    if not same:
        for x, y in zip(na, nb):
            for k in x:
                if x[k] != y.get(k):
                    print(" differs:", k, str(x[k])[:300], "vs", str(y.get(k))[:300])
    for k in ("mechanisms", "epsilon_split"):
        print(k, "identical:", a[k] == b[k])
        if a[k] != b[k]:
            print("  ", a[k], "\n  ", b[k])
    return 0 if same and a["mechanisms"] == b["mechanisms"] and a["epsilon_split"] == b["epsilon_split"] else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
