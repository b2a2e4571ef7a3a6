"""The experiment runner's grid parsing, resumption and summaries (no simulation needed)."""

import json
from pathlib import Path

import pytest

from common.config import ConfigError
from fedsyn_server.experiment import cell_run_config, collect, flatten, load_grid, pool_votes, summarise, write_summary

GRID = """
[experiment]
out-dir = "exp"
seeds = [0, 1]
num-supernodes = 3
metric = "utility/topic/accuracy"

[base]
num-synthetic = 30

[grid]
strong-fraction = [0.34, 0.67]
epsilon = [inf, 8.0]

[methods.zero-shot]
prompt = "zero-shot"

[methods.knn-vote]
refinement = "knn-vote"
"""


def test_grid_expands_methods_combinations_and_seeds(tmp_path):
    path = tmp_path / "g.toml"
    path.write_text(GRID)
    grid = load_grid(path)
    assert len(grid.cells) == 2 * 2 * 2 * 2
    assert grid.out_dir == (tmp_path / "exp").resolve()
    names = {c.name for c in grid.cells}
    assert len(names) == len(grid.cells)
    cell = grid.cells[0]
    assert dict(cell.run_config)["num-synthetic"] == 30 and dict(cell.run_config)["prompt"] == "zero-shot"


def test_a_grid_on_a_preset_takes_its_keys_under_base_and_its_schema_on_one_line(tmp_path):
    """``preset`` in [experiment]: the table preset's keys (its schema written over several
    lines) are every cell's base, [base] wins, and the schema goes to ``flwr run`` as one line
    (a key=value pair cannot hold a line break)."""
    from pathlib import Path

    from fedsyn_server.flwr_runner import toml_value

    preset = Path(__file__).parents[1] / "presets" / "table-breast-cancer.toml"
    path = tmp_path / "g.toml"
    path.write_text(f'[experiment]\npreset = "{preset}"\nseeds = [0]\n[base]\ntest-fraction = 0.2\n')
    rc = dict(load_grid(path).cells[0].run_config)
    assert rc["dataset"] == "breast-cancer" and rc["control-columns"] == "diagnosis" and rc["test-fraction"] == 0.2
    assert "\n" not in rc["table-schema"] and json.loads(rc["table-schema"])["columns"][0]["name"] == "diagnosis"
    assert toml_value(rc["table-schema"]).startswith("'{")
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(json.loads(rc["table-schema"]), indent=2))
    path.write_text(f'[experiment]\npreset = "{preset}"\n[base]\ntable-schema = "schema.json"\n')
    # read from the grid's folder
    assert dict(load_grid(path).cells[0].run_config)["table-schema"] == rc["table-schema"]


def test_grid_with_a_bad_value_fails_before_any_run(tmp_path):
    path = tmp_path / "g.toml"
    path.write_text(GRID.replace('refinement = "knn-vote"', 'refinement = "magic"'))
    with pytest.raises(ConfigError, match="refinement"):
        load_grid(path)
    path.write_text(GRID.replace("[experiment]", "[experimnt]"))
    with pytest.raises(ValueError, match=r"unknown section\(s\) \['experimnt'\]"):
        load_grid(path)
    path.write_text(GRID.replace("[experiment]", "[experiment]\nsed = [1]"))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['sed'\] in \[experiment\]"):
        load_grid(path)


def test_summary_resumes_from_finished_cells_and_writes_tables_and_plots(tmp_path):
    path = tmp_path / "g.toml"
    path.write_text(GRID)
    grid = load_grid(path)
    done = grid.cells[::2]  # half the cells "finished"
    for i, cell in enumerate(done):
        run = grid.out_dir / "runs" / cell.name
        run.mkdir(parents=True)
        (run / "evaluation.json").write_text(json.dumps({"utility": {"topic": {"accuracy": 0.5 + 0.01 * i}}}))
        (run / "pool.jsonl").write_text("\n".join(json.dumps({"text": "t", "votes": float(v)}) for v in range(5)))
        (run / "metrics.json").write_text(json.dumps({"timings_s": {"finetune": 10.0 * i, "total": 20.0 + 10 * i}}))
    rows = collect(grid)
    assert len(rows) == len(done)
    assert [r["seconds/total"] for r in rows] == [20.0 + 10 * i for i in range(len(done))]  # quality per second
    write_summary(grid, rows)
    assert (grid.out_dir / "results.csv").read_text().count("\n") == len(done) + 1
    md = (grid.out_dir / "results.md").read_text()
    assert "utility/topic/accuracy" in md and "±" in md
    assert (grid.out_dir / "plots" / "metric_vs_strong_fraction.png").exists()
    assert (grid.out_dir / "plots" / "vote_distributions.png").exists()
    from benchmarks.front import main as front_main

    assert front_main([str(grid.out_dir / "results.csv"), "--out", str(tmp_path / "front.png")]) == 0
    assert (tmp_path / "front.png").stat().st_size > 0


def test_the_front_keeps_exactly_the_points_nothing_beats_on_both_time_and_quality():
    from benchmarks.front import front

    pts = [{"label": k, "t": t, "y": y} for k, t, y in
           [("fast", 60, 0.6), ("slow-better", 300, 0.8), ("slow-worse", 300, 0.5), ("mid", 150, 0.7),
            ("mid-dominated", 160, 0.69), ("tie", 150, 0.7)]]
    assert [p["label"] for p in front(pts)] == ["fast", "mid", "tie", "slow-better"]  # equal points both stay


def test_flatten_and_summarise():
    assert flatten({"a": {"b": 1, "c": "x"}, "d": 2.5, "e": True}) == {"a/b": 1.0, "d": 2.5}
    rows = [{"method": "m", "seed": s, "x/acc": v} for s, v in enumerate([0.5, 0.7])]
    (entry,) = summarise(rows, ["method"], ["x/acc"])
    assert entry["n"] == 2 and entry["x/acc"][0] == pytest.approx(0.6) and entry["x/acc"][1] == pytest.approx(0.1)


def test_cli_summary_only(tmp_path, capsys):
    from fedsyn_server.cli import main

    path = tmp_path / "g.toml"
    path.write_text(GRID)
    assert main(["experiment", str(path), "--summary-only"]) == 1  # nothing finished yet
    assert "0 of 16 cells finished" in capsys.readouterr().out
    assert main(["experiment", str(tmp_path / "missing.toml")]) == 2


def test_a_cell_cut_off_with_a_checkpoint_is_resumed(tmp_path):
    path = tmp_path / "g.toml"
    path.write_text(GRID)
    grid = load_grid(path)
    runs, cell = grid.out_dir / "runs", grid.cells[0]
    assert "resume" not in cell_run_config(cell, runs)
    (runs / cell.name / "checkpoint").mkdir(parents=True)
    (runs / cell.name / "checkpoint" / "state.json").write_text("{}")
    rc = cell_run_config(cell, runs)
    assert rc["resume"] == str(runs / cell.name) and rc["run-name"] == cell.name


def test_run_app_appends_the_commands_output_to_the_cells_log(tmp_path):
    """A cell's `flwr run` output lands in its log file (appended per attempt), not only in memory."""
    from fedsyn_server.flwr_runner import run_app

    log_path = tmp_path / "logs" / "cell.log"
    first = run_app({}, app_dir=tmp_path / "no-app", log_path=log_path, timeout=120)
    second = run_app({}, app_dir=tmp_path / "no-app", log_path=log_path, timeout=120)
    assert first.returncode != 0 and not first.ok
    assert "Failed to load Flower App" in first.output  # flwr's own error, read back from the file
    text = log_path.read_text()
    assert text.count("=== ") == 2 and first.output in text and text.endswith(second.output)
    assert "\x1b[" not in text  # flwr colours its lines; a log file gets them plain


def test_run_app_times_out_a_silent_command(tmp_path, monkeypatch):
    import time

    from fedsyn_server import flwr_runner

    with open(tmp_path / "log", "wb") as out:
        t0 = time.time()
        code, timed_out = flwr_runner._run_to(["sleep", "30"], {}, out, timeout=1)
    assert timed_out and code == -1 and time.time() - t0 < 10
    with open(tmp_path / "log", "wb") as out:
        assert flwr_runner._run_to(["printf", "\x1b[92mINFO\x1b[0m: hi\\n"], {}, out, timeout=30) == (0, False)
    assert (tmp_path / "log").read_bytes() == b"INFO: hi\n"


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).parents[1] / "benchmarks").glob("*.toml")))
def test_every_shipped_grid_loads_and_every_cell_is_a_valid_run_config(name):
    grid = load_grid(Path(__file__).parents[1] / "benchmarks" / name)
    assert grid.cells and all(cell.run_config for cell in grid.cells)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_grid_stopped_by_a_signal_stops_the_processes_its_cell_started(tmp_path, sig):
    """``fedsyn experiment`` started in the background (SIGINT ignored, as under ``nohup ... &``)
    and then signalled must stop what its cell started (here a stand-in for the SuperLink, found
    like it by the FLWR_HOME on its command line), not die and leave it running."""
    import os
    import signal
    import subprocess
    import sys

    from fedsyn_server.flwr_runner import alive

    home = tmp_path / "flwr-home"
    script = (
        "import os, subprocess, sys, time\n"
        "from pathlib import Path\n"
        "from fedsyn_server.flwr_runner import stop_processes_of, stopped_on_signals\n"
        "home = Path(os.environ['STAND_IN_HOME'])\n"  # not on this command line: only the stand-in names it
        "try:\n"
        "    with stopped_on_signals():\n"
        "        try:\n"
        "            link = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', str(home)])\n"
        "            print(link.pid, flush=True)\n"
        "            time.sleep(300)\n"
        "        finally:\n"
        "            stop_processes_of(home)\n"
        "except KeyboardInterrupt as stop:\n"
        "    print('stopped', stop, flush=True)\n"
    )
    grid = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[1], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "STAND_IN_HOME": str(home)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    link = int(grid.stdout.readline())
    assert alive(link)
    grid.send_signal(getattr(signal, sig))
    out, _ = grid.communicate(timeout=60)
    assert f"stopped {sig}" in out and grid.returncode == 0
    assert not alive(link)


def test_vote_histograms_keep_each_writer_and_refinement_apart(tmp_path):
    """kNN counts and contrastive ±1 sums are different statistics: Fig. A.3 never pools them."""
    path = tmp_path / "g.toml"
    path.write_text(GRID + '\n[methods.dp-contrastive]\nrefinement = "contrastive-vote"\n')
    grid = load_grid(path)
    for cell in grid.cells:
        run = grid.out_dir / "runs" / cell.name
        run.mkdir(parents=True)
        sign = -1.0 if cell.method == "dp-contrastive" else 1.0
        (run / "pool.jsonl").write_text("\n".join(json.dumps({"text": "t", "votes": sign * v}) for v in range(3)))
    votes = pool_votes(grid)
    assert set(votes) == {"pretrained (zero-shot), contrastive-vote", "finetuned, knn-vote",
                          "finetuned, contrastive-vote"}
    assert all(v <= 0 for v in votes["finetuned, contrastive-vote"])
    assert all(v >= 0 for v in votes["finetuned, knn-vote"])
