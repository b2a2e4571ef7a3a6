"""The node operator's commands, run on the node: ``fedsyn ledger``, ``fedsyn node-check``, ``fedsyn node``.

They are registered with the ``fedsyn`` command through the ``fedsyn.commands`` entry point
(``pyproject.toml``), so the server's CLI never imports the node's code.

- ``fedsyn ledger STATE_DIR``: the node's privacy ledger (budget, spent, every release);
  ``--set-budget EPS --reason ...`` changes the budget (the only way it changes: a node whose
  node-config ``epsilon`` differs from its ledger's refuses to serve); ``--reset --reason ...``
  starts over, recorded (``--budget`` where the ledger is damaged or missing);
  ``--release-holds`` ends every pre-flight hold.
- ``fedsyn node-check --node-config '...'``: the start-up check of a SuperNode (its policy, data,
  the models it allows, its audit folder, its FAB gate: every launcher, the allow-list, the approved
  trees, the venv and who can change them, Flower's exact version). Reads, writes nothing but a new node's
  first ledger, spends nothing.
- ``fedsyn node fab-hash|approve|install-launcher``: the FAB gate (``fedsyn_client.fab_gate``).
- ``fedsyn audit --node-config '...'``: what each release of this node really loses, measured on
  the node's own records (``fedsyn_client.privacy_audit``); exit 1 naming a release that breaks its
  statement.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from fedsyn_client.refusals import NodeSetupError


def add_ledger(subparsers: argparse._SubParsersAction) -> None:
    """Register ``fedsyn ledger``."""
    p = subparsers.add_parser(
        "ledger", help="show, re-budget or reset a node's privacy ledger",
        description="What this node's records have spent: budget, epsilon by basic composition and by a "
                    "PLD accountant at the cumulative delta, and every release. Run it on the node.",
    )
    p.add_argument("state_dir", help="the node's state-dir (node-config state-dir; default ~/.fedsyn/state)")
    p.add_argument("--ledger-id", default="", help="the node-config ledger-id, if the node sets one")
    p.add_argument("--json", action="store_true", help="print the whole ledger summary as JSON")
    p.add_argument("--set-budget", type=float, default=None, metavar="EPSILON",
                   help="change the node's total epsilon (needs --reason); then set the same node-config epsilon")
    p.add_argument("--delta", type=float, default=None,
                   help="with --set-budget: the node's new delta (its releases are composed at it); then set the "
                        "same node-config delta")
    p.add_argument("--reset", action="store_true",
                   help="archive the ledger and start an empty one (e.g. new data); needs --reason")
    p.add_argument("--budget", type=float, default=None, metavar="EPSILON",
                   help="with --reset: the budget of the new ledger (required when the old one is damaged or missing)")
    p.add_argument("--unlimited", action="store_true",
                   help="with --set-budget inf or --budget inf: yes, this node's records get no privacy at all")
    p.add_argument("--reason", default="", help="why (kept in the ledger)")
    p.add_argument("--release-holds", action="store_true",
                   help="end every pre-flight hold (e.g. of a run that crashed and will not be resumed)")
    p.add_argument("--html", default=None, metavar="PAGE",
                   help="write one self-contained page of everything the node released (budget over time, every "
                        "release, refusals, approved apps) to PAGE, for the people who sign off the node")
    p.add_argument("--allow-list", default=None, metavar="FILE", help="with --html: the node's allow-list (its apps)")
    p.add_argument("--audit-dir", default=None, metavar="DIR",
                   help="with --html: the node's audit-dir (its outgoing replies: the refusals)")
    p.set_defaults(handler=_run_ledger)


def add_node_check(subparsers: argparse._SubParsersAction) -> None:
    """Register ``fedsyn node-check``."""
    p = subparsers.add_parser(
        "node-check", help="check a SuperNode's node config and data before starting it",
        description="Run on the node with the --node-config you give flower-supernode: loads the policy, the "
                    "data file and the ledger as the first request of a run will, and prints one line, or the "
                    "reason (by file) and exit 1. Flower runs no app code when a SuperNode starts, so this is "
                    "the start-up check (deploy/start_local_deployment.sh runs it). Spends nothing, and never "
                    "changes a budget.",
    )
    p.add_argument("--node-config", required=True, help='e.g. \'tier="weak" data-path="site.csv" epsilon=8\'')
    p.add_argument("--allow-any-fab", action="store_true",
                   help="ready without a FAB gate on PATH (a test bed: any app the server sends runs on the records)")
    p.add_argument("--clientapp-user", default=None, metavar="USER",
                   help="the user ClientApps run as (deploy/start_node.sh --run-as); default: whoever runs this")
    p.add_argument("--same-user", action="store_true",
                   help="ClientApps run as the operator who owns the gate, allow-list and venv: accept that the "
                        "approved app could change them (a single-user node; --run-as separates them)")
    p.set_defaults(handler=_run_node_check)


def _run_node_check(args: argparse.Namespace) -> int:
    from common.config import parse_pairs
    from fedsyn_client.approval import gate_status
    from fedsyn_client.node import check_node

    config = parse_pairs([args.node_config], "--node-config")
    try:
        ready = check_node(config)
        try:
            gate = gate_status(args.clientapp_user, args.same_user)
        except (ValueError, RuntimeError) as err:
            if not args.allow_any_fab:
                raise NodeSetupError(f"FAB gate: {err}") from None
            gate = f"NO FAB GATE (--allow-any-fab): any app the server sends runs on the records ({err})"
    except NodeSetupError as err:
        print(f"fedsyn node-check: {err}", file=sys.stderr)
        return 1
    print(f"{ready}\n{gate}")
    return 0


def add_audit(subparsers: argparse._SubParsersAction) -> None:
    """Register ``fedsyn audit``."""
    from fedsyn_client.privacy_audit import DEFAULT_BOUND, DEFAULT_CONFIDENCE, DEFAULT_DRAWS

    p = subparsers.add_parser(
        "audit", help="measure what each release of this node really loses (an empirical lower bound on epsilon)",
        description="Run on the node with its --node-config: for each release the node serves in the run described "
                    "(profile, a vote of each registered histogram, marginals), runs the node's real release path "
                    "on neighbouring copies of its records (one record added or removed, below, at and above "
                    "max-records) with the noise off and on, and bounds from below the epsilon each release really "
                    "loses. Prints stated epsilon against the lower bound; exit 1 naming a release whose bound or "
                    "measured sensitivity exceeds its statement. Nothing leaves the machine; the node's ledger and "
                    "state are never opened (a temporary folder holds a copy of its view secret). docs/privacy.md"
                    "#the-audit says how it works and what it can see.",
    )
    p.add_argument("--node-config", default=None, help='the node to audit, e.g. \'tier="weak" data-path="site.csv" '
                                                        'max-records=10000 epsilon=8\'')
    p.add_argument("--canaries", type=int, default=None, metavar="M",
                   help="instead: audit a whole simulated run (DP-SGD included) by M canary records, half of them "
                        "put in its data, and a membership test on its synthetic set and model (one run)")
    p.add_argument("--seed", type=int, default=0, help="with --canaries: the canaries' and their coins' seed")
    p.add_argument("--run-config", default="", help="the run to audit, as flwr run --run-config takes it "
                                                     "(default: the default run; with --node-config on the node's "
                                                     "columns and budget)")
    p.add_argument("--draws", type=int, default=DEFAULT_DRAWS,
                   help=f"noised releases per side of the worst pair, at most (default {DEFAULT_DRAWS}; fewer where "
                        "the released vector is long)")
    p.add_argument("--max-records", type=int, default=None,
                   help=f"the audit's max-records: its files' sizes (default the node's, at most {DEFAULT_BOUND})")
    p.add_argument("--confidence", type=float, default=None,
                   help=f"per release: a correct one fails with probability at most 1 - this (default "
                        f"{DEFAULT_CONFIDENCE}; with --canaries 0.95)")
    p.add_argument("--release", action="append", default=None, metavar="NAME",
                   help="audit this release only: profile, vote:HISTOGRAM (e.g. vote:knn-vote) or marginals, or "
                        "at min-honest-nodes > 1 a masked round's: profile/share, vote:knn-vote/sum, ... "
                        "(repeat for several; default every one the node serves)")
    p.add_argument("--sum", action="store_true",
                   help="at min-honest-nodes = t > 1: audit too the sum of a masked round of t sites simulated "
                        "from this node (each its own state and keys), against the release's epsilon under its "
                        "trust; without it, each masked release's share is audited against peers that collude "
                        "with the server (its epsilon alone)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(handler=_run_audit)


def _run_audit(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from common.config import parse_pairs
    from common.io import jsonable
    from fedsyn_client.privacy_audit import DEFAULT_CONFIDENCE, AuditError, format_audit, run_audit

    if (args.node_config is None) == (args.canaries is None):
        raise ValueError("give --node-config (this node's releases) or --canaries M (a whole simulated run), one")
    overrides = parse_pairs([args.run_config], "--run-config") if args.run_config.strip() else None
    if args.confidence is not None and not 0 < args.confidence < 1:
        raise ValueError(f"--confidence {args.confidence}: must be in (0, 1)")
    if args.canaries is not None:
        # the run-level audit is the server's (it runs the pipeline): found as a plug-in, so the node's
        # code never imports the server's
        from importlib.metadata import entry_points

        if args.canaries < 2:
            raise ValueError("--canaries needs at least 2 canaries")
        (canaries,) = entry_points(group="fedsyn.audits", name="canaries")
        return int(canaries.load()(args.canaries, overrides, args.seed, args.confidence or 0.95))
    node_config = parse_pairs([args.node_config], "--node-config")
    if args.draws < 2 or (args.max_records is not None and args.max_records < 2):
        raise ValueError("--draws and --max-records must be at least 2")
    try:
        audit = run_audit(node_config, overrides, args.max_records, args.draws,
                          args.confidence or DEFAULT_CONFIDENCE, args.release,
                          progress=sys.stderr.isatty(), sums=args.sum)
    except (NodeSetupError, AuditError) as err:
        print(f"fedsyn audit: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(jsonable({"results": [{**asdict(r), "lower": r.lower, "failed": r.failed}
                                               for r in audit.results],
                                   "max_records": audit.bound, "pairs": audit.pairs, "seconds": audit.seconds}),
                         indent=2))
    else:
        print(format_audit(audit))
    if audit.failed:
        print(f"fedsyn audit: FAILED: {', '.join(r.kind for r in audit.failed)} break their statement",
              file=sys.stderr)
        return 1
    return 0


def add_node(subparsers: argparse._SubParsersAction) -> None:
    """Register ``fedsyn node fab-hash|approve|install-launcher|folders|service`` (the gate, folders, service)."""
    p = subparsers.add_parser(
        "node", help="the node's FAB gate: hash, approve and pin the app it runs",
        description="A SuperNode runs the ClientApp the server ships in its FAB. The gate (fedsyn_client/fab_gate.py) "
                    "runs only FABs whose SHA-256 is in the node's allow-list. Build the hash from the checkout "
                    "you reviewed; the server's `flwr run` must build from identical files.",
    )
    sub = p.add_subparsers(dest="node_command", required=True)
    h = sub.add_parser("fab-hash", help="print the SHA-256 of the FAB `flwr run CHECKOUT` would send")
    h.add_argument("checkout")
    a = sub.add_parser("approve", help="add the FAB hash of a reviewed checkout to the node's allow-list")
    a.add_argument("checkout")
    a.add_argument("--allow-list", required=True, help="the node's allow-list file (created if missing)")
    a.add_argument("--note", default="", help="who reviewed it, or why (kept as a comment)")
    i = sub.add_parser("install-launcher", help="write the gate into DIR, one launcher per task process Flower starts "
                                                "(flwr-clientapp, flwr-agentapp, ...); "
                                                "put DIR first in the SuperNode's PATH")
    i.add_argument("dir")
    i.add_argument("--allow-list", required=True, help="the node's allow-list file")
    f = sub.add_parser("folders", help="print the folders this node's ClientApps write (state-dir, audit-dir), one "
                                       "per line: what the user they run as must own (deploy/start_node.sh --run-as)")
    f.add_argument("--node-config", required=True, help="the node config flower-supernode gets")
    v = sub.add_parser("service", help="write a systemd unit and its environment file that keep this node running "
                                       "(deploy/start_node.sh --foreground: node-check before each start, restarted "
                                       "on failure); docs/deployment.md#an-operators-day")
    v.add_argument("--name", required=True, help="the node's name: the unit is fedsyn-node-NAME.service")
    v.add_argument("--out", required=True, help="the folder for the unit and its environment file (e.g. /etc/fedsyn)")
    for flag, what in (("--superlink", "HOST:PORT of the operator's SuperLink"),
                       ("--node-config", "this node's policy"), ("--allow-list", "the node's allow-list file")):
        v.add_argument(flag, required=True, help=what)
    v.add_argument("--work", default=None, help="start_node.sh's --work (default /var/lib/fedsyn-node/NAME)")
    v.add_argument("--run-as", default="", metavar="USER", help="ClientApps run as USER (start_node.sh --run-as)")
    v.add_argument("--same-user", action="store_true", help="ClientApps run as the service's user, root")
    v.add_argument("--root-certificates", default=None, help="TLS to the SuperLink with this CA certificate")
    v.add_argument("--auth-key", default=None, help="SuperNode authentication: this node's private key")
    v.add_argument("--port", type=int, default=None, help="the SuperNode's Runtime API port (default: free)")
    v.add_argument("--flwr-bin", default=None, help="the node venv's bin folder (default: this fedsyn's)")
    v.add_argument("--start-script", default=None,
                   help="the reviewed checkout's deploy/start_node.sh (default: the one beside this fedsyn's code, "
                        "an editable install's)")
    p.set_defaults(handler=_run_node)


def _run_node(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fedsyn_client.approval import approve, describe_checkout, fab_hash, install_launcher
    from fedsyn_client.fab_gate import apps_dir

    if args.node_command == "fab-hash":
        print(f"{fab_hash(args.checkout)}  ({describe_checkout(args.checkout)})")
    elif args.node_command == "approve":
        digest = approve(args.checkout, args.allow_list, args.note)
        print(f"approved {digest} in {args.allow_list}; its tree, the only one the gate imports: "
              f"{apps_dir(Path(args.allow_list).expanduser().resolve()) / digest}")
    elif args.node_command == "folders":
        from common.config import parse_pairs
        from fedsyn_client.node import node_folders

        try:
            print("\n".join(str(f) for f in node_folders(parse_pairs([args.node_config], "--node-config")).values()))
        except NodeSetupError as err:
            print(f"fedsyn node folders: {err}", file=sys.stderr)
            return 1
    elif args.node_command == "service":
        return _write_service(args)
    else:
        path = install_launcher(args.dir, args.allow_list)
        print(f"wrote the gate's launchers into {path.parent}; start the SuperNode with PATH={path.parent}:$PATH (and "
              "fedsyn node-check in the same environment)")
    return 0


def _write_service(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fedsyn_client.node_service import NodeService, write_service

    def absolute(path: str | None) -> Path | None:
        return Path(path).expanduser().resolve() if path else None

    service = NodeService(
        name=args.name, superlink=args.superlink, node_config=args.node_config,
        allow_list=Path(args.allow_list).expanduser().resolve(),
        work=absolute(args.work) or Path("/var/lib/fedsyn-node") / args.name,
        flwr_bin=absolute(args.flwr_bin) or Path(sys.executable).parent,
        start_script=absolute(args.start_script) or Path(__file__).resolve().parents[1] / "deploy" / "start_node.sh",
        run_as=args.run_as, same_user=args.same_user, root_certificates=absolute(args.root_certificates),
        auth_key=absolute(args.auth_key), port=args.port)
    try:
        unit, env = write_service(service, Path(args.out))
    except ValueError as err:
        print(f"fedsyn node service: {err}", file=sys.stderr)
        return 1
    print(f"wrote {unit} and {env} (the node's settings)\n"
          f"check it:  systemd-analyze verify {unit}\n"
          f"install:   systemctl link {unit} && systemctl enable --now {unit.name}\n"
          f"watch:     journalctl -fu {unit.name}     stop: systemctl stop {unit.name}")
    return 0


def _run_ledger(args: argparse.Namespace) -> int:
    from common.io import jsonable
    from fedsyn_client.ledger import PrivacyLedger, ledger_path, reset_ledger, set_budget

    try:
        if args.reset and args.set_budget is not None:
            raise ValueError("--reset takes the new ledger's budget as --budget EPSILON, not --set-budget")
        if args.delta is not None and args.set_budget is None:
            raise ValueError("--delta changes with the budget: fedsyn ledger STATE_DIR --set-budget EPSILON "
                             "--delta DELTA --reason '...'")
        for flag, value in (("--set-budget", args.set_budget), ("--budget", args.budget)):
            if value is not None and not (value > 0 and math.isfinite(value)) and not args.unlimited:
                raise ValueError(f"{flag} {value:g}: a budget is a finite epsilon > 0; an unlimited budget (no "
                                 "privacy at all) needs --unlimited as well")
        if args.reset:
            archive = reset_ledger(args.state_dir, args.reason, args.ledger_id, args.budget)
            print("ledger reset" + (f"; the old one is archived at {archive}" if archive else
                                    "; there was no ledger to archive"))
            return 0
        if args.set_budget is not None:
            old = set_budget(args.state_dir, args.set_budget, args.reason, args.ledger_id, args.delta)
            print(f"budget changed: epsilon {old:g} -> {args.set_budget:g}; "
                  f"set node-config epsilon={args.set_budget:g}"
                  + (f" delta={args.delta:g}" if args.delta is not None else ""))
            return 0
        path = ledger_path(args.state_dir, args.ledger_id)
        if not path.exists():
            raise FileNotFoundError(f"no ledger at {path} (is {args.state_dir} the node's state-dir?)")
        if args.release_holds:
            ended = PrivacyLedger(path).release_hold()
            print(f"ended {len(ended)} hold(s){': runs ' + ', '.join(ended) if ended else ''}")
            return 0
        summary = PrivacyLedger(path).summary()
    except NodeSetupError as err:
        print(f"fedsyn ledger: {err}", file=sys.stderr)
        return 1
    if args.html:
        from pathlib import Path

        from common.io import atomic_write_text
        from fedsyn_client.ledger_page import ledger_page

        page = ledger_page(summary, Path(args.allow_list) if args.allow_list else None,
                           Path(args.audit_dir) if args.audit_dir else None)
        atomic_write_text(args.html, page)
        print(f"wrote {args.html} ({len(summary['releases'])} releases; open it in any browser, offline)")
        return 0
    # JSON has no Infinity: an unlimited budget is written "inf", as in the ledger file
    print(json.dumps(jsonable(summary), indent=2) if args.json else format_ledger(summary))
    return 0


def _trust(public: dict) -> str:
    """A masked release's two guarantees, for its row: the trust it was charged under, and alone."""
    if not public.get("secure_aggregation"):
        return ""
    return f"  (masked, min-honest-nodes {public.get('honest')}; alone epsilon {float(public['epsilon_alone']):.4g})"


def _composed(summary: dict) -> str:
    """The spent line's composition: at the policy's delta, what admission holds to the budget
    (issue 75); a ledger that never stored its policy, at the releases' summed delta."""
    if "epsilon_composed" in summary:  # stated where the ledger holds its policy's delta
        return (f"{summary['epsilon_composed']:.4g} (PLD at the policy's delta = "
                f"{float(summary['policy']['delta']):.3g})")
    return f"{summary['epsilon_pld']:.4g} (PLD at the summed delta = {summary['delta_spent']:.3g})"


def format_ledger(summary: dict) -> str:
    """A node's ledger summary as a readable table."""
    from common.html_page import when as _when

    lines = [
        f"ledger           {summary['ledger']}",
        f"budget           epsilon = {float(summary['budget']):g}",
        f"spent            epsilon = {summary['epsilon_spent']:.4g} (basic composition), " + _composed(summary),
        f"remaining        epsilon = {float(summary['epsilon_remaining']):.4g}"
        + (f" ({summary['epsilon_held']:.4g} held for runs under way: {', '.join(summary['holds'])})"
           if summary.get("holds") else ""),
        f"delta spent      {summary['delta_spent']:.3g}",
    ]
    if "epsilon_alone" in summary:  # masked releases (issue 73): the guarantee without the trust
        lines.append(f"if the rest collude  epsilon = {summary['epsilon_alone']:.4g} at the policy's delta: every "
                     "masked release by this node's own noise share alone (the spent figures count the sum's "
                     "noise, under min-honest-nodes)")
    for change in summary["budget_changes"]:
        moved = f", delta {change.get('delta_from')} -> {change['delta_to']:g}" if "delta_to" in change else ""
        lines.append(f"budget change    {float(change['from']):g} -> {float(change['to']):g}{moved} at "
                     f"{_when(change['time'])}" + (f": {change['reason']}" if change.get("reason") else ""))
    for reset in summary["resets"]:
        spent = reset["previous_epsilon_spent"]
        lines.append(f"reset            {_when(reset['time'])}: {reset['reason']} (previously spent "
                     f"{spent:.4g})" if isinstance(spent, (int, float)) and math.isfinite(spent) else
                     f"reset            {_when(reset['time'])}: {reset['reason']} (previously spent {spent})")
    header = f"{'time':19}  {'run':>20}  {'phase':8} {'round':>5}  {'mechanism':9} {'epsilon':>8} {'delta':>8}  status"
    lines += ["", header, "-" * len(header)]
    for r in summary["releases"]:
        lines.append(f"{_when(r.get('time', 0)):19}  {str(r['run_id'])[-20:]:>20}  {r['phase']:8} {r['round']:>5}  "
                     f"{r['mechanism']:9} {float(r['epsilon']):8.4g} {float(r['delta']):8.2g}  {r['status']}"
                     + _trust(r.get("public") or {}))
    if not summary["releases"]:
        lines.append("(no releases)")
    return "\n".join(lines)

