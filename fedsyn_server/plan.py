"""``fedsyn plan [flwr run arguments]``: check a run and say what it will cost, spending nothing.

It reads the run config exactly as ``flwr run`` would send it (the app's defaults plus the
command line's overrides), validates it, loads the dataset, its vocabulary and (in simulation)
the partitions the ClientApps would get, then prints per phase the ε, δ and noise each node
will use and the time this machine's benchmark (``benchmarks/throughput_cpu.json``) predicts.
Every problem is one line; the exit code is 1 when there is any.

Noise is computed as the nodes compute it (``common.dp``): the analytic Gaussian σ of the
profile and the votes, and DP-SGD's noise multiplier at q = B / |D_i|. In simulation the
partition sizes are known to whoever holds the whole dataset, i.e. the person planning; in a
deployment they are each node's secret, and the plan cannot (and does not) say them.

For a deployment (a SuperLink connection with an address), ``fedsyn plan`` submits the run
with ``plan-only = true``: the ServerApp asks the nodes the tier query (free: it reads their
policies and ledgers, spends nothing, and the holds it takes are ended at once) and logs one
``plan:`` line per fact, which this command picks out of the stream. A node's refusal (its
policy forbids the model, a column, the epsilon) is a problem line naming the node.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.accounting import Pld, calibrate
from common.calibration import Planned
from common.config import ConfigError, RunConfig
from common.dp import STRONG
from common.phases import Pricing, phases

if TYPE_CHECKING:
    from strategies.result import FedSynResult

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "throughput_cpu.json"
DEFAULT_SIMULATED_NODES = 2  # Flower's simulation default since 1.32
PLAN_LINE = "plan: "  # the ServerApp's plan-only log lines start with it
LOCAL_SUPERLINK = ":local:"  # Flower's address of the SuperLink `flwr run` starts itself (simulation)


@dataclass
class Plan:
    """What ``fedsyn plan`` found: problems (one line each) and the lines of the cost table."""

    problems: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def num_supernodes(flwr_args: list[str]) -> int:
    """``num-supernodes`` from ``--federation-config`` (else Flower's default of 2)."""
    from flwr.common.config import parse_config_args

    values = [flwr_args[i + 1] for i, a in enumerate(flwr_args[:-1]) if a == "--federation-config"]
    values += [a.split("=", 1)[1] for a in flwr_args if a.startswith("--federation-config=")]
    try:
        return int(parse_config_args(values).get("num-supernodes", DEFAULT_SIMULATED_NODES)) if values else \
            DEFAULT_SIMULATED_NODES
    except ValueError:
        return DEFAULT_SIMULATED_NODES


def connection_address(flwr_args: list[str]) -> str | None:
    """The address of the SuperLink connection ``flwr run`` would use with ``flwr_args`` (the
    positional after the app folder, else the default in ``$FLWR_HOME/config.toml``); None when
    there is no such connection (``flwr run`` then fails and says so)."""
    import click
    from flwr.cli.flower_config import read_superlink_connection

    from fedsyn_server.flwr_args import connection_name

    try:
        return read_superlink_connection(connection_name(flwr_args)).address
    except (click.ClickException, OSError, ValueError):
        return None


def plan_run(flwr_args: list[str], cwd: Path) -> Plan:
    """Validate the run ``flwr_args`` describe and compute its cost table: locally for a
    simulation, through the nodes' tier query for a deployment."""
    from fedsyn_server.flwr_args import effective_run_config, relative_paths

    out = Plan()
    try:
        raw = effective_run_config(flwr_args)
        raw.update(relative_paths(raw, cwd))
        cfg = RunConfig.from_flower(raw)
    except (ConfigError, ValueError, OSError) as err:
        out.problems.append(f"run config: {err}")
        return out
    address = connection_address(flwr_args)
    if address and address != LOCAL_SUPERLINK:
        return plan_deployment(flwr_args, cwd, address)
    nodes = num_supernodes(flwr_args)
    try:
        from common.federation import benchmark, simulation_node_data

        bench = benchmark(cfg)
        parts = [simulation_node_data(cfg, p, nodes) for p in range(nodes)]
    except Exception as err:  # noqa: BLE001 - every data problem becomes one line of the plan
        out.problems.append(f"data: {err}")
        return out
    out.lines.append(f"dataset {cfg.dataset}: {len(bench.train)} training records, {len(bench.test)} held out, "
                     f"vocabulary {len(bench.vocabulary)} codes; {nodes} simulated nodes "
                     f"({sum(t == STRONG for t, _ in parts)} strong)")
    speed = _speeds()
    for pid, (tier, data) in enumerate(parts):
        if len(data) == 0:
            out.problems.append(f"node {pid} ({tier}) gets no records: use fewer nodes or another partitioning")
            continue
        out.lines.append(f"node {pid} ({tier}, {len(data)} records):")
        out.lines += ["  " + line for line in _phase_lines(cfg, tier, len(data), cfg.resolve_delta(len(bench.train)),
                                                            speed)]
    out.lines += _server_lines(cfg, parts, speed)
    out.lines.append(f"accounting: the simulated nodes price their releases by {cfg.accounting!r} (sigma above "
                     "under both rules; a deployed node follows its own node-config accounting)")
    if cfg.min_honest_nodes > 1:
        out.lines.append(shared_noise_line(cfg.min_honest_nodes, nodes))
    if cfg.writes_text:
        out.lines.append(writers_line(cfg, [t for t, _ in parts]))
    return out


def plan_deployment(flwr_args: list[str], cwd: Path, address: str) -> Plan:
    """Submit the run with ``plan-only = true`` to the SuperLink at ``address`` and collect the
    ServerApp's ``plan:`` lines (and its one-line failure, as a problem)."""
    import os
    import subprocess
    import tempfile

    from fedsyn_server.app_stage import with_staged_app
    from fedsyn_server.flwr_args import connection_name, with_absolute_paths
    from fedsyn_server.flwr_runner import flwr_cli, run_status

    out = Plan(lines=[f"deployment at {address}: asking the nodes' tier query (free; nothing is spent)"])
    with tempfile.TemporaryDirectory(prefix="fedsyn-plan-") as scratch:
        args = with_absolute_paths(flwr_args, cwd, Path(scratch)) + ["--run-config", "plan-only=true"]
        args = with_staged_app(args, Path(scratch))
        command = [flwr_cli(), "run", *args] + ([] if "--stream" in args else ["--stream"])
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
    output = proc.stdout + proc.stderr
    for line in output.splitlines():
        if PLAN_LINE in line:
            out.lines.append(line.split(PLAN_LINE, 1)[1])
        elif " failed: " in line and "fedsyn run" in line:
            problem = line.split(" failed: ", 1)[1]
            out.problems += [] if problem in out.problems else [problem]
    # the run's status from the SuperLink it was submitted to, not the default connection's
    status = run_status(output, dict(os.environ), connection_name(flwr_args)) if proc.returncode == 0 else ""
    if proc.returncode != 0:
        out.problems.append(f"`flwr run` exited {proc.returncode}: {output.strip().splitlines()[-1:] or ''}")
    elif not out.problems and status != "finished:completed":
        out.problems.append(f"the plan run ended {status or 'without a status'} (`flwr ls` for details)")
    return out


def deployment_lines(cfg: RunConfig, answered: dict[int, str], result: FedSynResult, delta: float) -> list[str]:
    """The plan of a deployment from stage 0: per node that answered, its tier, budget and each
    phase's epsilon and noise; per node that refused or failed the tier query, why. Record
    counts are each node's secret; a node's public bound (max-records) fixes its q, so its noise
    multiplier and the time of each release are shown at that bound."""
    tiers = list(answered.values())
    lines = [f"{len(answered)} node(s) answered the tier query: {tiers.count(STRONG)} strong, "
             f"{len(tiers) - tiers.count(STRONG)} weak"]
    for nid, tier in sorted(answered.items()):
        bound = result.bounds.get(nid) or None
        lines.append(f"node {nid} ({tier}, epsilon budget {result.budgets.get(nid, float('nan')):g}"
                     + (f", max-records {bound}: every release does the work of {bound} records" if bound else "")
                     + "):")
        lines += ["  " + line for line in _phase_lines(cfg, tier, bound, delta, _speeds() if bound else {},
                                                        result.budgets.get(nid))]
    lines += [f"node {f['node_id']} cannot take part: {f['reason']}" for f in result.failures
              if f["phase"] == "tiers" and f["node_id"] not in answered]
    trust = {nid: result.trust.get(nid, 1) for nid in answered}
    if any(t > 1 for t in trust.values()):
        lines.append(shared_noise_line(min(t for t in trust.values() if t > 1), len(answered),
                                       sorted(n for n, t in trust.items() if t > 1)))
    if cfg.writes_text:
        lines.append(writers_line(cfg, tiers))
    return lines


def shared_noise_line(honest: int, sites: int, which: list[int] | None = None) -> str:
    """The plan's line for a run whose sites share the noise (issue 73): the sums are masked, and
    each site adds 1/sqrt(t) of the noise above (as Skellam noise: a count's exact PLD, a rounded
    score's Renyi bound)."""
    who = f"nodes {', '.join(str(n) for n in which)} count" if which else "every site counts"
    return (f"shared noise: {who} on {honest} of the {sites} sites (min-honest-nodes): the profile, votes "
            "(similarity scores scaled and rounded) and marginals are masked sums, each site adding about "
            f"1/sqrt({honest}) of the noise above as "
            "Skellam noise, and a site refuses to unmask a round with fewer of the sites it counts "
            "(docs/privacy.md#shared-noise)")


def writers_line(cfg: RunConfig, tiers: list[str]) -> str:
    """Who will write the pool with these node ``tiers`` (``strategies.writers.effective_share``,
    the rule the run applies at stage 3): both writers under the votes, or the one that remains."""
    from strategies.refinement import build_refinement
    from strategies.writers import effective_share

    voters = len(tiers) if cfg.voters == "all" else sum(t != STRONG for t in tiers)
    try:
        method = build_refinement(cfg.refinement)
        asks_votes, on_policy = method.asks_votes, method.on_policy
    except ValueError:
        asks_votes, on_policy = True, False
    finetuned = cfg.trains and STRONG in tiers
    share, why = effective_share(cfg.pretrained_share, finetuned=finetuned, votes=asks_votes and voters > 0,
                                 on_policy=on_policy)
    who = (f"{voters} voter(s) ({cfg.voters})" if voters else
           f"no voter (voters = {cfg.voters!r} and no weak node)" if asks_votes else f"no vote ({cfg.refinement})")
    return f"writers: {why} [{who}]"


def _phase_lines(cfg: RunConfig, tier: str, records: int | None, delta: float, speed: dict[str, Any],
                 budget: float | None = None) -> list[str]:
    """Each phase's lines for a node of ``tier`` (``Phase.plan_lines``), in the nodes' order, as the
    node prices each under accounting = pld: all composed at the node's delta (taken to be the
    run's: in simulation it is); under basic each at its split of it (``basic_delta``, issue 60)."""
    from strategies.marginals import planned_marginals
    from strategies.refinement import planned_votes

    pricing = Pricing(cfg, tier, delta, sample_rate=min(1.0, cfg.batch_size / records) if records else 0.0,
                      votes=planned_votes(cfg) if cfg.writes_text else None, records=records, speed=speed,
                      budget=cfg.epsilon if budget is None else float(budget),
                      marginals=tuple(planned_marginals(cfg)) if cfg.marginals else ())
    planned = {phase.name: phase.planned(pricing) for phase in phases()}
    pld = pld_noises([p for p in planned.values() if p is not None], delta)
    lines: list[str] = []
    after_unknown_q = False  # composed with a DP-SGD phase at the node's q, unknown here: an upper bound
    for phase in phases():
        mine = planned[phase.name]
        lines += phase.plan_lines(pricing, mine, pld.get(phase.name, math.nan), after_unknown_q)
        after_unknown_q = after_unknown_q or bool(mine is not None and mine.q_unknown)
    return lines


def pld_noises(planned: list[Planned], delta: float | None = None) -> dict[str, float]:
    """Each planned phase's noise (sigma, or DP-SGD's noise multiplier) under accounting = pld, by
    the nodes' own rule (``common.accounting.calibrate``: a phase composes with every release
    before it, at the node's ``delta``; None: the phases' own). A DP-SGD phase whose sampling rate
    is unknown here (a deployment: the plan does not know a node's max-records) is left out; the
    phases after it are an upper bound."""
    return {p.phase: n for p, n in zip(planned, calibrate(planned, Pld.name, delta)) if not math.isnan(n)}


def _server_lines(cfg: RunConfig, parts: list[tuple[str, Any]], speed: dict[str, Any]) -> list[str]:
    if cfg.marginals:
        from strategies.refinement import final_size

        table = (f"server: sums the sites' marginals, fits a graphical model (Private-PGM) and samples "
                 f"{final_size(cfg)} rows")
        if cfg.free_text is None:
            return [table + "; no language model"]
        return [table + f", each with a text of its code in free-text column {cfg.free_text!r}",
                *_text_server_lines(cfg, speed)]
    return _text_server_lines(cfg, speed)


def _text_server_lines(cfg: RunConfig, speed: dict[str, Any]) -> list[str]:
    rate = speed.get("generation_tokens_per_s")
    passes = 1 if cfg.guidance == 1 else 2  # guidance runs the model once more per token
    tokens = passes * cfg.num_synthetic * (cfg.max_new_tokens or cfg.max_length)
    return [f"server: generates {cfg.num_synthetic} texts of at most {cfg.max_new_tokens or cfg.max_length} tokens"
            + (f" under guidance {cfg.guidance:g}" if passes == 2 else "")
            + (f", about {tokens / rate:.0f} s" if rate else "")
            + (f" (times from {BENCHMARK.name}: {speed.get('device')}, {speed.get('model')})" if speed else
               " (no benchmark of this machine: `python -m benchmarks.throughput` writes one)")]


def _speeds() -> dict[str, Any]:
    try:
        return json.loads(BENCHMARK.read_text())
    except (OSError, ValueError):
        return {}
