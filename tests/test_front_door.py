"""The front door: outputs and data paths are where the user is, and `latest` finds the newest run."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from common.io import atomic_symlink
from fedsyn_server.flwr_args import app_dir, effective_run_config, with_absolute_paths

APP = Path(__file__).resolve().parents[1]


def _last_pairs(args: list[str]) -> str:
    assert args[-2] == "--run-config"
    return args[-1]


def test_flwr_args_app_folder_and_effective_config():
    assert app_dir([".", "--stream"]) == Path(".")
    assert app_dir(["--run-config", "a=1", "--federation-config", "x=1", "proj", "remote"]) == Path("proj")
    assert app_dir(["--stream"]) == Path(".")
    cfg = effective_run_config([str(APP), "--run-config", 'epsilon=4.0 out-dir="runs"'])
    assert cfg["epsilon"] == 4.0 and cfg["out-dir"] == "runs" and cfg["model"] == "smollm2-135m"  # defaults kept


def test_default_out_dir_becomes_the_users_directory(tmp_path):
    args = with_absolute_paths([str(APP), "--stream"], tmp_path, tmp_path)
    assert args[:2] == [str(APP), "--stream"]
    assert _last_pairs(args) == f'out-dir="{tmp_path / "outputs"}"'  # pyproject's relative default


def test_relative_data_file_and_resume_resolved_but_names_and_absolute_paths_kept(tmp_path):
    args = [str(APP), "--run-config", 'dataset="data/notes.csv" resume="outputs/r1" out-dir="/abs/out"']
    pairs = _last_pairs(with_absolute_paths(args, tmp_path, tmp_path))
    assert f'dataset="{tmp_path / "data/notes.csv"}"' in pairs and f'resume="{tmp_path / "outputs/r1"}"' in pairs
    assert "out-dir" not in pairs  # already absolute
    for name in ("bbc-news", "someone/some-dataset"):  # the packaged data set and a hub id are not paths
        args = [str(APP), "--run-config", f'dataset="{name}" out-dir="/abs/out"']
        assert with_absolute_paths(args, tmp_path, tmp_path) == args


def test_a_toml_run_config_is_copied_with_absolute_paths(tmp_path):
    user = tmp_path / "mine.toml"
    user.write_text('epsilon = 4.0\ndataset = "notes.jsonl"\n')
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    args = with_absolute_paths([str(APP), "--run-config", str(user)], tmp_path, scratch)
    copy = Path(args[2])
    assert copy.parent == scratch and len(args) == 3  # Flower takes no pairs beside a TOML file
    merged = tomllib.loads(copy.read_text())
    assert merged == {"epsilon": 4.0, "dataset": str(tmp_path / "notes.jsonl"), "out-dir": str(tmp_path / "outputs")}
    assert user.read_text() == 'epsilon = 4.0\ndataset = "notes.jsonl"\n'  # the user's file is untouched


def test_fedsyn_run_dry_run_anywhere_prints_absolute_paths(tmp_path):
    """`fedsyn run . --dry-run` is dry too (argparse gave it to flwr before)."""
    for argv in (["run", "--dry-run", str(APP)], ["run", str(APP), "--dry-run"]):
        out = subprocess.run([sys.executable, "-m", "fedsyn_server.cli", *argv], cwd=tmp_path, capture_output=True,
                             text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        assert out.returncode == 0, out.stderr
        command = out.stdout.strip().splitlines()[-1]
        assert "--dry-run" not in command and f'out-dir="{tmp_path / "outputs"}"' in command


def test_server_resolves_relative_paths_in_its_working_directory_and_links_latest(tmp_path, monkeypatch):
    from common.config import RunConfig
    from fedsyn_server.server_app import LATEST, run_directory

    monkeypatch.chdir(tmp_path)
    cfg = RunConfig.from_flower({"out-dir": "outputs", "run-name": "first"})
    run_dir = run_directory(cfg, 7)
    assert run_dir == tmp_path / "outputs" / "first"
    for name in ("first", "second"):
        (tmp_path / "outputs" / name).mkdir(parents=True)
        atomic_symlink(tmp_path / "outputs" / LATEST, name)
        assert (tmp_path / "outputs" / LATEST).resolve() == tmp_path / "outputs" / name
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["first", "latest", "second"]  # no temp left


# --------------------------------------------------------------------------- after a run
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A whole run (real ServerApp and ClientApp logic, tiny model, fake Grid) with its outputs."""
    from flwr.app import Context, RecordDict

    from fedsyn_client.client_app import app as client_app
    from fedsyn_server import server_app
    from tests.fakes import FakeGrid, client_node, set_task_identity
    from tests.test_strategy import TOPICS, run_config, write_topic_csv

    root = tmp_path_factory.mktemp("run")
    rc = {**run_config(write_topic_csv(root / "news.csv", TOPICS, 30)), "out-dir": str(root / "out"), "run-name": "r"}
    nodes = {100 + p: client_node(client_app, 100 + p, {"partition-id": p, "num-partitions": 3,
                                                         "state-dir": str(root / "state" / f"node{p}")}, rc, run_id=5)
             for p in range(3)}
    set_task_identity()
    server_app._main(FakeGrid(nodes), Context(run_id=5, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    return root / "out" / "r"


def meta_allocation(path: Path) -> dict[str, int]:
    import json

    return json.loads(path.read_text())["allocation"]


def _ledgers(run_dir: Path) -> list[str]:
    return [p.read_text() for p in sorted((run_dir.parent.parent / "state").glob("node*/ledger.json"))]


def test_outputs_latest_and_the_held_out_split_has_the_synthetic_columns(finished_run):
    import json

    assert (finished_run.parent / "latest").resolve() == finished_run
    synthetic = [json.loads(line) for line in (finished_run / "synthetic.jsonl").read_text().splitlines()]
    heldout = [json.loads(line) for line in (finished_run / "heldout.jsonl").read_text().splitlines()]
    assert synthetic and heldout and set(heldout[0]) == {"text", "control_code", "topic"}
    assert set(synthetic[0]) == {"text", "control_code", "topic", "writer"}
    assert all(r["control_code"] == f"topic={r['topic']}" for r in heldout)


def test_each_kept_text_says_its_writer_and_every_report_what_the_votes_kept(finished_run):
    """The writer tag survives A.4's resampling into synthetic.jsonl, and profile.json,
    evaluation.json and the privacy report say per code the share each writer kept."""
    import json

    synthetic = [json.loads(line) for line in (finished_run / "synthetic.jsonl").read_text().splitlines()]
    pool = [json.loads(line) for line in (finished_run / "pool.jsonl").read_text().splitlines()]
    # A tiny model may write the same text under both writers (CI's run of stop 52 did), so a
    # kept text is matched to the pool as (text, code, writer), not looked up by its text alone.
    tagged = {(r["text"], r["control_code"], r["writer"]) for r in pool}
    assert {r["writer"] for r in pool} == {"pretrained", "finetuned"}
    assert all((r["text"], r["control_code"], r["writer"]) in tagged for r in synthetic)
    assert [r["writer"] for r in pool if r["selected"]] == [r["writer"] for r in synthetic]
    for name in ("profile.json", "evaluation.json", "privacy_report.json"):
        writers = json.loads((finished_run / name).read_text())["writers"]
        assert writers["pretrained_share"] == 0.5 and "votes choose" in writers["why"]
        for code, shares in writers["kept_share"].items():
            mine = [r["writer"] for r in synthetic if r["control_code"] == code]
            assert shares == {w: mine.count(w) / len(mine) for w in ("finetuned", "pretrained")}
    assert json.loads((finished_run / "privacy_report.json").read_text())["writers"]["epsilon"] == 0.0
    assert (finished_run / "plots" / "writers.png").is_file()


def test_generate_more_spends_nothing_and_carries_the_privacy_report(finished_run, tmp_path, capsys):
    import json

    from fedsyn_server.cli import main

    before = _ledgers(finished_run)
    assert main(["generate", str(finished_run), "-n", "9", "--seed", "3", "--out", str(tmp_path / "more.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "more.jsonl").read_text().splitlines()]
    vocabulary = json.loads((finished_run / "profile.json").read_text())["vocabulary"]
    assert 0 < len(rows) <= 9 and all(r["control_code"] in vocabulary and r["text"].strip() for r in rows)
    # each code written by the two writers in the shares the run's votes kept, and each row says which
    assert {r["writer"] for r in rows} <= {"pretrained", "finetuned"}
    kept = json.loads((finished_run / "profile.json").read_text())["writers"]["kept_share"]
    for code, n in meta_allocation(tmp_path / "more.privacy.json").items():
        mine = [r["writer"] for r in rows if r["control_code"] == code]
        if n and code in kept and len(mine) == n:
            assert mine.count("pretrained") == math.floor(kept[code]["pretrained"] * n + 0.5)
    meta = json.loads((tmp_path / "more.privacy.json").read_text())
    assert meta["epsilon_spent"] == 0 and meta["nodes_asked"] == 0 and meta["seed"] == 3
    assert sum(meta["allocation"].values()) in range(7, 12)  # the run's noisy profile scaled to 9 (rounding)
    assert meta["run_privacy_report"] == json.loads((finished_run / "privacy_report.json").read_text())
    assert _ledgers(finished_run) == before  # no node was asked for anything
    code = vocabulary[0]
    assert main(["generate", str(finished_run), "--allocation", f"{code}:4", "--out", str(tmp_path / "a.jsonl")]) == 0
    assert {json.loads(line)["control_code"] for line in (tmp_path / "a.jsonl").read_text().splitlines()} <= {code}
    capsys.readouterr()
    for argv, says in ((["-n", "0"], "below 1"), (["--allocation", "topic=nope:3"], "CODE one of"), ([], "-n N")):
        with pytest.raises(SystemExit) if argv[:2] == ["-n", "0"] else _nothing():
            assert main(["generate", str(finished_run), *argv]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(["generate", str(tmp_path), "-n", "3"]) == 2
    assert "not a finished fedsyn run" in capsys.readouterr().err


def test_the_run_page_is_written_from_a_real_runs_outputs(finished_run, tmp_path):
    """``fedsyn report`` (issue 64) on a real run's folder: every section, each of its plots inline."""
    from fedsyn_server.cli import main
    from fedsyn_server.report_page import SECTIONS
    from tests.test_ledger_page import _Page

    assert main(["report", str(finished_run), "--out", str(tmp_path / "report.html")]) == 0
    page = _Page()
    page.feed((tmp_path / "report.html").read_text())
    plots = list((finished_run / "plots").glob("*.png"))
    assert set(SECTIONS) <= set(page.ids) and plots and len(page.links) == len(plots)
    assert all(link.startswith("data:image/png;base64,") for link in page.links) and "script" not in page.tags


def test_export_is_a_loadable_dataset_with_a_card_that_states_the_privacy(finished_run, tmp_path):
    import json

    import pandas as pd
    from datasets import load_from_disk

    from fedsyn_server.cli import main

    assert main(["export", str(finished_run), "--out", str(tmp_path / "ds")]) == 0
    ds = load_from_disk(str(tmp_path / "ds"))["train"]
    synthetic = [json.loads(line) for line in (finished_run / "synthetic.jsonl").read_text().splitlines()]
    assert ds.to_list() == synthetic and {"writer"} <= set(ds.column_names)
    assert pd.read_parquet(tmp_path / "ds" / "data" / "train-00000-of-00001.parquet").to_dict("records") == synthetic
    card = (tmp_path / "ds" / "README.md").read_text()
    report = json.loads((finished_run / "privacy_report.json").read_text())
    for node in report["nodes"]:
        assert f"| {node['node_id']} | {node['tier']} | {node['epsilon_spent']:.4g} |" in card
    code = synthetic[0]["control_code"]
    mine = [r["writer"] for r in synthetic if r["control_code"] == code]
    assert f"| `{code}` | {len(mine)} | " + ", ".join(f"{w} {mine.count(w)}" for w in sorted(set(mine))) + " |" in card
    assert "differential-privacy" in card and "tiny-gpt2" in card and f"**Rows:** {len(synthetic)}" in card
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no half-written folder left


def test_cli_arguments_are_checked_with_one_line_each(tmp_path, capsys):
    from fedsyn_server.cli import main

    for argv in (["evaluate", "--synthetic", "s.jsonl", "--real", "r.jsonl", "--epochs", "-1"],
                 ["experiment", "grid.toml", "--timeout", "0"]):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert "give a value >=" in err and len(err.strip().splitlines()) == 1


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_plan_prints_each_phases_cost_and_one_line_per_problem(tmp_path, capsys):
    from fedsyn_server.cli import main

    # the default: every node votes, a strong node's non-profile epsilon split between DP-SGD and its votes
    assert main(["plan", str(APP), "--run-config", "epsilon=4.0 epsilon-profile=1.0"]) == 0
    out = capsys.readouterr().out
    strong, weak = out.split("node 1 (weak, 1001 records)")
    assert "train: epsilon 1.5, delta 1e-05, DP-SGD noise multiplier" in strong and "vote: epsilon 1.5 in 1" in strong
    assert "vote: epsilon 3 in 1" in weak and "2 voter(s) (all)" in weak
    assert main(["plan", str(APP), "--run-config", 'epsilon=4.0 epsilon-profile=1.0 voters="weak"']) == 0
    out = capsys.readouterr().out
    assert "node 0 (strong, 1001 records)" in out and "node 1 (weak, 1001 records)" in out
    assert "train: epsilon 3, delta 1e-05, DP-SGD noise multiplier" in out and "q = 0.032" in out
    assert "vote: epsilon 3 in 1 round(s)" in out and "profile: epsilon 1" in out and "nothing was spent" in out
    assert "writers: each code's pool 50% by the pretrained model, 50% by the finetuned one" in out
    assert "1 voter(s)" in out and "shared noise" not in out  # t = 1: the plan of today's run
    assert main(["plan", str(APP), "--run-config", "min-honest-nodes=2"]) == 0
    assert "shared noise: every site counts on 2 of the 2 sites" in capsys.readouterr().out
    # the default contrastive votes, K = 4: sensitivity sqrt(8)
    import re

    from common.dp import analytic_gaussian_sigma

    # basic: its share 3/4 of the policy's delta (issue 60)
    basic = analytic_gaussian_sigma(3.0, 1e-5 * 3 / 4, 8 ** 0.5)
    assert f"sigma {basic:.3g} per round (sensitivity sqrt(2K) = 2.83; basic; " in out
    # issue 47: the same budget under pld (the weak node's vote composed with its profile) needs less noise
    pld = float(re.search(r"sqrt\(2K\) = 2.83; basic; ([0-9.]+) under accounting = pld", out).group(1))
    assert 0.5 * basic < pld < 0.95 * basic
    assert "accounting: the simulated nodes price their releases by 'pld'" in out
    assert main(["plan", str(APP), "--run-config", "refinement=\"none\""]) == 0  # no vote: one writer, said
    assert "writers: no vote judges the pool" in capsys.readouterr().out
    assert main(["plan", str(APP), "--run-config", "refinement=\"pe-contrastive\" refinement-rounds=3"]) == 0
    assert ("in 3 round(s), delta 1e-05, "
            f"Gaussian sigma {analytic_gaussian_sigma(6 / 3, 1e-5 * 6 / 8 / 3, 2 ** 0.5):.3g} "
            "per round (sensitivity sqrt(2K) = 1.41; basic; ") in capsys.readouterr().out  # pe-contrastive: K = 1
    for override, says in (('partitioning="strong-codes:sport,nope"', "control code 'nope' is not in the vocabulary"),
                           ('dataset="missing.csv"', "does not exist"), ("epsilon=-1", "epsilon = -1.0")):
        assert main(["plan", str(APP), "--run-config", override]) == 1
        captured = capsys.readouterr()
        assert says in captured.err and len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err


def test_plan_asks_a_deployment_and_reads_its_connection_like_flwr(tmp_path, monkeypatch):
    from common.config import ConfigError, RunConfig
    from fedsyn_server.flwr_args import connection_name
    from fedsyn_server.plan import connection_address, deployment_lines
    from strategies.result import FedSynResult

    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    (tmp_path / "config.toml").write_text('[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n\n'
                                          '[superlink.site]\naddress = "10.0.0.5:9093"\n')
    assert connection_address(["."]) == ":local:"  # the default: a simulation, planned here
    assert connection_address([".", "site", "--stream"]) == "10.0.0.5:9093"
    assert connection_address(["--run-config", "a=1", ".", "--federation-config", "x=2", "site"]) == "10.0.0.5:9093"
    assert connection_address([".", "nowhere"]) is None  # flwr run says what is wrong
    assert connection_name([".", "--run-config", "site", "site"]) == "site" and connection_name(["."]) is None
    assert app_dir(["-c", "x=1", "myapp", "site"]) == Path("myapp")

    assert RunConfig.from_flower({"plan-only": "true"}).plan_only and not RunConfig().plan_only
    with pytest.raises(ConfigError, match="plan-only"):
        RunConfig.from_flower({"plan-only": 1})
    result = FedSynResult()
    result.budgets = {7: 8.0, 9: 4.0}
    result.failures = [{"node_id": 11, "phase": "tiers", "reason": "refused: policy: model 'x' is not allowed"}]
    lines = deployment_lines(RunConfig(), {7: "strong", 9: "weak"}, result, 1e-5)
    assert lines[0] == "2 node(s) answered the tier query: 1 strong, 1 weak"
    assert "node 7 (strong, epsilon budget 8):" in lines and "node 9 (weak, epsilon budget 4):" in lines
    train = [line for line in lines if "train:" in line]
    assert len(train) == 1 and "never sent" in train[0]  # |D| is the node's secret: no noise multiplier here
    assert lines[-2] == "node 11 cannot take part: refused: policy: model 'x' is not allowed"
    assert lines[-1].startswith("writers: each code's pool 50% by the pretrained model")
    assert "2 voter(s) (all)" in lines[-1]


# --------------------------------------------------------------------------- the README, walked
TINY_RUN = ('model="tiny-gpt2" num-server-rounds=1 local-steps=2 batch-size=4 max-length=32 num-synthetic=20 '
            'max-new-tokens=8')
FIRST_SCREEN = ("fedsyn plan .", "fedsyn run . --stream", "fedsyn generate outputs/latest -n",
                "fedsyn export outputs/latest", 'datasets.load_from_disk("outputs/latest/export")')


@pytest.mark.flwr
def test_a_new_user_walks_the_readme(tmp_path):
    """As the README says, from an empty directory: plan, run (the tiny model instead of SmolLM2),
    find the outputs under ./outputs/latest, generate more, export, load the export."""
    import json
    import shlex
    import tempfile

    from datasets import load_from_disk

    from fedsyn_server.flwr_runner import flwr_env, stop_processes_of

    readme = (APP / "README.md").read_text()
    for command in FIRST_SCREEN:
        assert command in readme, f"the README no longer says {command!r}"
    home = Path(tempfile.mkdtemp(prefix="fedsyn-flwr-home-"))
    env = flwr_env(home)
    fedsyn = str(Path(sys.executable).with_name("fedsyn"))

    def run(command: str, *extra: str, timeout: int = 900) -> subprocess.CompletedProcess:
        argv = [fedsyn] + [str(APP) if a == "." else a for a in shlex.split(command)[1:]] + list(extra)
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{command}: {(done.stdout + done.stderr)[-3000:]}"
        return done

    # three sites, one strong; the weak ones vote with the sentiment-seeing embedder while the
    # server still scores with MiniLM (this run is also the tiny `flwr run` whose outputs CI checks)
    three = ("--run-config", TINY_RUN + ' strong-fraction=0.34 embedder="all-MiniLM-L6-v2+vader"',
             "--federation-config", "num-supernodes=3")
    try:
        assert "nothing was spent" in run("fedsyn plan .", *three).stdout
        run("fedsyn run . --stream", *three)
    finally:
        stop_processes_of(home)
    from tests.test_flwr_run import check_tiny_run_outputs

    latest = tmp_path / "outputs" / "latest"
    assert latest.is_symlink()
    synthetic = check_tiny_run_outputs(latest)
    assert "texts written to" in run("fedsyn generate outputs/latest -n 6").stdout
    [more] = list((latest / "more").glob("*.jsonl"))
    assert json.loads((latest / "more" / f"{more.stem}.privacy.json").read_text())["epsilon_spent"] == 0
    run("fedsyn export outputs/latest")
    assert load_from_disk(str(latest / "export"))["train"].to_list() == synthetic


def test_loose_edges_unknown_embedder_and_flowers_evaluation_warning(tmp_path, capsys, caplog):
    """An unknown embedder is one line (was a 20-line traceback); building the phase-1 aggregator
    no longer repeats Flower's `fraction_evaluate` warning a user cannot act on."""
    from fedsyn_server.cli import main
    from strategies.aggregators import build_aggregator

    rows = "\n".join('{"text": "a match was won %d", "control_code": "topic=sport"}' % i for i in range(6))
    (tmp_path / "s.jsonl").write_text(rows + "\n")
    assert main(["evaluate", "--synthetic", str(tmp_path / "s.jsonl"), "--real", str(tmp_path / "s.jsonl"),
                 "--embedder", "no-such-owner/no-such-embedder", "--no-mauve"]) == 2
    err = capsys.readouterr().err
    assert "could not load embedder 'no-such-owner/no-such-embedder'" in err and "all-MiniLM-L6-v2" in err
    assert len(err.strip().splitlines()) == 1
    with caplog.at_level("WARNING", logger="flwr"):
        for name in ("fedavg", "fedadam"):
            build_aggregator(name, 1.0, 2)
    assert "fraction_evaluate" not in caplog.text


def test_fedsyn_run_refuses_a_local_superlink_started_under_another_ray_address(tmp_path):
    """Issue 24: `flwr run` reuses the local SuperLink, which reads RAY_ADDRESS only at its start:
    a run meant for the Ray cluster would silently simulate on this machine (and the reverse)."""
    from fedsyn_server.flwr_runner import stale_local_superlink, stop_pids

    home = str(tmp_path / "home")
    link = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "flower-superlink"],
                            env={**os.environ, "FLWR_HOME": home, "RAY_ADDRESS": ""})
    try:
        deadline = time.time() + 10
        while time.time() < deadline and "flower-superlink" not in Path(f"/proc/{link.pid}/cmdline").read_text():
            time.sleep(0.05)
        problem = stale_local_superlink({"FLWR_HOME": home, "RAY_ADDRESS": "10.0.0.1:6379"})
        assert f"(PID {link.pid}) was started without RAY_ADDRESS" in problem
        assert "not on the Ray cluster at 10.0.0.1:6379" in problem and f"kill {link.pid}" in problem
        assert stale_local_superlink({"FLWR_HOME": home}) == ""  # the same (no) cluster: fine
        assert stale_local_superlink({"FLWR_HOME": str(tmp_path / "other"), "RAY_ADDRESS": "x:1"}) == ""  # not reused
    finally:
        stop_pids([link.pid])


def test_an_inline_table_schema_survives_flowers_key_value_parser(tmp_path):
    """Issue 25: Flower ends a double-quoted pair at its first '"': JSON goes in single quotes;
    fedsyn run reads a schema file into the run config the same way."""
    import json

    from flwr.common.config import parse_config_args

    from fedsyn_server.flwr_args import toml_value

    schema = json.dumps({"columns": [{"name": "mean radius", "type": "float", "min": 0}]})
    pairs = f"table-schema={toml_value(schema)} epsilon={toml_value(4.0)} out-dir={toml_value('a b')}"
    assert parse_config_args([pairs]) == {"table-schema": schema, "epsilon": 4.0, "out-dir": "a b"}
    (tmp_path / "s.json").write_text(schema)
    args = with_absolute_paths([".", "--run-config", "table-schema='s.json'"], tmp_path, tmp_path)
    assert json.loads(parse_config_args([args[-1]])["table-schema"]) == json.loads(schema)
    with pytest.raises(ValueError, match="TOML file"):
        toml_value("""{"name": "Crohn's"}""")


def test_plan_times_guidance_as_a_second_forward_pass_per_token():
    from common.config import RunConfig
    from fedsyn_server.plan import _server_lines

    speed = {"generation_tokens_per_s": 64.0, "device": "cpu", "model": "m"}
    plain = _server_lines(RunConfig(num_synthetic=10, max_length=64), [], speed)[0]
    guided = _server_lines(RunConfig(num_synthetic=10, max_length=64, guidance=1.5), [], speed)[0]
    assert "64 tokens, about 10 s" in plain and "64 tokens under guidance 1.5, about 20 s" in guided


def test_every_preset_is_a_run_config_the_app_accepts():
    """A preset is a public interface (the README and the grids name them): each one, over the app's
    defaults, must pass the run config's checks, and each of its values must reach the run."""
    from common.config import RunConfig

    presets = sorted((APP / "presets").glob("*.toml"))
    assert {p.name for p in presets} >= {"quality-cpu.toml", "gpu.toml", "rotten-tomatoes.toml",
                                         "movie-review-source.toml"}
    for preset in presets:
        cfg = effective_run_config([str(APP), "--run-config", str(preset)])
        RunConfig.from_flower(cfg)  # ConfigError names the key
        for key, value in tomllib.loads(preset.read_text()).items():
            assert key == "table-schema" or cfg[key] == value, (preset.name, key)
