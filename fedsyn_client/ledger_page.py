"""``fedsyn ledger STATE_DIR --html PAGE``: one self-contained page of everything a node released (issue 64).

For the person who signs off a hospital's participation (a data-protection officer, an ethics board),
who reads pages, not JSON: the budget and what is left, the budget used over time (a plot), every
release per run and phase (mechanism, sigma, sensitivity, epsilon, delta, status), the budget's
changes and resets, the refusals by kind (from the node's outgoing-message audit folder, where it has
one), and the app versions the node approved and who approved them (its allow-list).

Self-contained and offline: the plot is an inline PNG, the style inline, no script and nothing fetched
from the network, so the page opens from a USB stick on a machine with no connection. Every value
from the ledger, the allow-list or the audit folder is HTML-escaped.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from common.html_page import (
    document,
    escape as _e,
    figure_uri,
    image,
    number as _num,
    section,
    table as _table,
    when as _when,
)

SECTIONS = ("summary", "budget-over-time", "releases", "refusals", "apps", "changes")


def budget_plot(releases: list[dict[str, Any]], budget: float) -> str:
    """The budget used over time as an inline PNG (``data:`` URI): the running sum of the epsilon of
    every counted release (confirmed, failed and reserved: a failure stays charged) by basic
    composition, and the budget as a line. "" when nothing was released."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counted = sorted((float(r.get("time", 0.0)), float(r["epsilon"])) for r in releases
                     if r.get("status") != "cancelled" and math.isfinite(float(r["epsilon"])))
    if not counted:
        return ""
    times = [t for t, _ in counted]
    total, running = 0.0, []
    for _, eps in counted:
        total += eps
        running.append(total)
    from datetime import datetime

    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=100)
    # from 0 just before the first release to the last, with a margin: a run's releases come seconds apart
    pad = max(60.0, 0.05 * (times[-1] - times[0]))
    xs = [times[0] - pad, *times, times[-1] + pad]
    stamps = np.array([datetime.fromtimestamp(t) for t in xs], dtype="datetime64[s]")
    ax.step(stamps, [0.0, *running, running[-1]], where="post", marker="o", markevery=list(range(1, len(xs) - 1)),
            label="epsilon spent (basic composition)")
    if math.isfinite(budget):
        ax.axhline(budget, color="#a40000", linestyle="--", label=f"budget {budget:g}")
    ax.set_xlim(stamps[0], stamps[-1])
    ax.set_ylim(0, 1.08 * max(running[-1], budget if math.isfinite(budget) else 0.0))
    ax.set_ylabel("epsilon")
    ax.legend(loc="upper left")
    fig.autofmt_xdate()
    fig.tight_layout()
    return figure_uri(fig)


def approved_apps(allow_list: Path) -> list[tuple[str, str]]:
    """(FAB hash, what its line says of it: checkout, version, when approved, the reviewer's note) for each
    hash the node's gate approves (``fab_gate.read_allow_list``: a damaged list raises ``ValueError``
    naming the line, as the gate refuses it), in the list's order."""
    from fedsyn_client.fab_gate import read_allow_list

    approved, out = read_allow_list(allow_list), []
    for line in allow_list.read_text(encoding="utf-8").splitlines():
        digest, _, comment = line.partition("#")
        if digest.strip() in approved:
            out.append((digest.strip(), comment.strip()))
    return out


def refusals(audit_dir: Path) -> Counter[tuple[str, str]]:
    """(message type, the fixed reason the node answered) of every error reply in the node's
    outgoing-message audit folder (``fedsyn_client.audit``), counted."""
    counts: Counter[tuple[str, str]] = Counter()
    for path in sorted(audit_dir.glob("node-*.jsonl")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and isinstance(entry.get("error"), dict):
                counts[(str(entry.get("message_type", "")), str(entry["error"].get("reason", "")))] += 1
    return counts


def ledger_page(summary: dict[str, Any], allow_list: Path | None = None, audit_dir: Path | None = None) -> str:
    """The page of a node's ledger ``summary`` (``PrivacyLedger.summary``), with its ``allow_list`` and
    outgoing-message ``audit_dir`` where given: one HTML document, every section of ``SECTIONS``."""
    budget = float(summary["budget"])
    releases = list(summary["releases"])
    parts = [f"<h1>What this node released: {_e(summary['ledger'])}</h1>",
             f'<p class="muted">Written {_e(_when(time.time()))} by <code>fedsyn ledger --html</code>, from the '
             "node's own ledger. Every release a server received was noised on this node first.</p>"]
    spent_pld = summary.get("epsilon_composed", summary["epsilon_pld"])
    parts.append(section("summary", "Budget", _table(
        ("budget epsilon", "spent (basic)", "spent (PLD)", "remaining", "delta spent", "held for runs under way"),
        [[_num(budget), _num(summary["epsilon_spent"]), _num(spent_pld), _num(summary["epsilon_remaining"]),
          _num(summary["delta_spent"], 3), _num(summary.get("epsilon_held", 0.0))]], numeric=range(6))))
    plot = budget_plot(releases, budget)
    parts.append(section("budget-over-time", "Budget used over time",
                         image(plot, "epsilon spent over time against the budget") if plot
                         else '<p class="muted">Nothing released yet.</p>'))
    rows = []

    def order(r: dict[str, Any]) -> tuple[str, str, int]:
        return str(r.get("run_id", "")), str(r.get("phase", "")), int(r.get("round", 0))

    for r in sorted(releases, key=order):
        public = r.get("public") or {}
        # DP-SGD's noise multiplier is in the release's node-only part; the page is the node's own
        noise = public.get("sigma", (r.get("private") or {}).get("noise_multiplier", ""))
        rows.append([_e(r.get("run_id", "")), _e(r.get("phase", "")), _e(r.get("round", 0)), _e(r.get("mechanism", "")),
                     _e(public.get("histogram", "")), _num(noise),
                     _num(public.get("sensitivity", public.get("max_grad_norm", ""))), _num(r.get("epsilon")),
                     _num(r.get("delta"), 3), _e(r.get("status", "")), _e(_when(r.get("time")))])
    parts.append(section("releases", "Releases, per run and phase", (_table(
        ("run", "phase", "round", "mechanism", "histogram", "sigma (or noise multiplier)",
         "sensitivity (or clipping norm)", "epsilon", "delta", "status", "time"), rows, numeric=(2, 5, 6, 7, 8))
        if rows else '<p class="muted">No releases.</p>')))
    failed = Counter(str(r.get("phase", "")) for r in releases if r.get("status") == "failed")
    refused = refusals(audit_dir) if audit_dir is not None and audit_dir.is_dir() else None
    body = ""
    if refused:
        body += _table(("request", "the node's answer", "times"),
                       [[_e(m), _e(reason), _e(n)] for (m, reason), n in refused.most_common()], numeric=(2,))
    elif refused is None:
        body += ('<p class="muted">No audit folder given (<code>--audit-dir</code>, the node config\'s '
                 "<code>audit-dir</code>): refusals are in the node's log only.</p>")
    else:
        body += "<p>No request was refused.</p>"
    if failed:
        body += ('<p class="warn">Releases that failed after their reservation (charged, nothing sent): '
                 + ", ".join(f"{_e(p)} {n}" for p, n in sorted(failed.items())) + "</p>")
    parts.append(section("refusals", "Refusals, by kind", body))
    apps = approved_apps(allow_list) if allow_list is not None and allow_list.exists() else None
    parts.append(section("apps", "Approved app versions", (
        _table(("FAB SHA-256", "checkout, version, when approved, note"), [[f"<code>{_e(d)}</code>", _e(c)]
                                                                           for d, c in apps])
        if apps else '<p class="muted">' + ("The allow-list approves no app." if apps is not None else
                                           "No allow-list given (<code>--allow-list</code>).") + "</p>")))
    changes = [[_e(_when(c.get("time"))), _e(f"budget {_num(c.get('from'))} → {_num(c.get('to'))}"),
                _e(c.get("reason", ""))] for c in summary.get("budget_changes", [])]
    changes += [[_e(_when(c.get("time"))), _e(f"reset (previously spent {_num(c.get('previous_epsilon_spent'))})"),
                 _e(c.get("reason", ""))] for c in summary.get("resets", [])]
    parts.append(section("changes", "Budget changes and resets", (
        _table(("time", "change", "reason"), sorted(changes)) if changes else "<p>None.</p>")))
    return document(f"fedsyn ledger: {summary['ledger']}", parts)
