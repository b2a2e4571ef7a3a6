"""Devices: the one helper that moves inputs to a model's device, and the same paths on CUDA.

The tests marked ``gpu`` run each path that feeds a model on CUDA (a DP-SGD step, the
held-out loss, generation, a vote, the transformer classifier, a full ``flwr run`` through
``fedsyn run``) and are skipped where torch sees no GPU, so CI on CPU stays green. Run them
on a GPU machine with ``pytest -m gpu``. The tests without the mark check the helpers on CPU.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from common.devices import client_resources, hidden_gpu_warning, model_device, to_device

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch")


# --------------------------------------------------------------------------- helpers (CPU)
def test_to_device_moves_nested_batches_to_the_models_device():
    model = torch.nn.Linear(2, 2)
    batch = {"a": torch.ones(2), "b": [torch.zeros(1), (torch.zeros(1), "x")], "n": 3}
    moved = to_device(batch, model)
    assert moved["a"].device == model_device(model) and moved["n"] == 3
    assert isinstance(moved["b"][1], tuple) and moved["b"][1][1] == "x"
    assert model_device(torch.nn.ReLU()) == torch.device("cpu")  # no parameters: CPU


def test_client_resources_share_each_gpu_between_two_clients():
    assert client_resources(0, 16) == {}
    assert client_resources(1, 16) == {"client-resources-num-gpus": 0.5, "client-resources-num-cpus": 8}
    assert client_resources(4, 16)["client-resources-num-cpus"] == 2


def test_fedsyn_run_passes_everything_through_and_adds_gpu_resources():
    from fedsyn_server.cli import flwr_run_command

    cmd = flwr_run_command([".", "--stream", "--federation-config", "num-supernodes=4"], num_gpus=1, num_cpus=16)
    assert cmd[1:4] == ["run", ".", "--stream"]
    assert cmd[-1] == "num-supernodes=4 client-resources-num-gpus=0.5 client-resources-num-cpus=8"
    own = flwr_run_command([".", "--federation-config=client-resources-num-gpus=1"], num_gpus=1, num_cpus=16)
    assert own[-1] == "--federation-config=client-resources-num-gpus=1 client-resources-num-cpus=8"  # user's wins
    assert flwr_run_command([".", "--stream"], num_gpus=0, num_cpus=2)[1:] == ["run", ".", "--stream"]


def test_a_hidden_gpu_is_named_with_its_fix(monkeypatch):
    import common.devices as devices

    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(devices, "gpu_on_machine", lambda: 1)
    message = hidden_gpu_warning()
    assert message and "fedsyn run" in message and "client-resources-num-gpus" in message
    monkeypatch.setattr(devices, "gpu_on_machine", lambda: 0)
    assert hidden_gpu_warning() is None


# --------------------------------------------------------------------------- on CUDA
@pytest.fixture(scope="module")
def tiny_cuda():
    from common.models import load_generator

    return load_generator("tiny-gpt2", device="cuda")


@pytest.mark.gpu
@needs_cuda
def test_dpsgd_step_on_cuda(tiny_cuda):
    from common.weights import prepare_model
    from fedsyn_client.training import TrainSettings, dp_train

    model, tok = tiny_cuda
    model = prepare_model(model, "lora", 2, seed=0)
    settings = TrainSettings(local_steps=2, batch_size=4, learning_rate=1e-3, max_length=16, max_grad_norm=1.0,
                             noise_multiplier=1.0)
    result = dp_train(model, tok, [f"text number {i}" for i in range(16)], ["topic=a"] * 16, settings, 1e-5, [])
    assert model_device(model).type == "cuda" and result.steps == 2 and math.isfinite(result.epsilon)


@pytest.mark.gpu
@needs_cuda
def test_heldout_loss_and_generation_on_cuda(tmp_path):
    from common.config import RunConfig
    from common.data import TextData
    from fedsyn_server.synthesis import ServerModel

    server = ServerModel(RunConfig(model="tiny-gpt2", max_new_tokens=4))
    assert model_device(server.model).type == "cuda"
    loss = server.heldout_loss(server.initial_arrays(), TextData(["a held-out text"] * 20, ["topic=a"] * 20))
    assert math.isfinite(loss["heldout_loss"])
    texts, codes = server.generate({"topic=a": 3, "topic=b": 2}, seed=0)
    assert len(texts) == 5 and codes.count("topic=b") == 2


@pytest.mark.gpu
@needs_cuda
def test_vote_on_cuda():
    from common.models import embed, load_embedder
    from common.voting import knn_votes

    embedder = load_embedder(device="cuda")
    local = embed(embedder, ["the match was won", "shares fell today"])
    votes = knn_votes(local, ["topic=s", "topic=b"], embed(embedder, ["a goal", "a bank"]), ["topic=s", "topic=b"], 1)
    assert str(embedder.device).startswith("cuda") and np.array_equal(votes, [1.0, 1.0])


@pytest.mark.gpu
@needs_cuda
def test_transformer_classifier_on_cuda():
    from fedsyn_server.evaluation import transformer_utility

    syn = ["goal match team"] * 6 + ["bank shares market"] * 6
    labels = ["sport"] * 6 + ["business"] * 6
    result = transformer_utility(syn, labels, syn, labels, max_steps=4, device="cuda")
    assert 0.0 <= result["accuracy"] <= 1.0


@pytest.mark.gpu
@pytest.mark.flwr
@needs_cuda
def test_fedsyn_run_trains_strong_nodes_on_the_gpu(tmp_path):
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from fedsyn_server.flwr_runner import APP_DIR, flwr_env, stop_processes_of

    home = Path(tempfile.mkdtemp(prefix="fedsyn-gpu-home-"))
    overrides = (f'model="tiny-gpt2" num-server-rounds=1 local-steps=2 batch-size=4 num-synthetic=8 '
                 f'max-new-tokens=4 out-dir="{tmp_path}" run-name="gpu"')
    try:
        proc = subprocess.run([str(Path(sys.executable).with_name("fedsyn")), "run", str(APP_DIR), "--stream",
                               "--run-config", overrides], env=flwr_env(home), capture_output=True, text=True,
                              timeout=900, check=False)
    finally:
        stop_processes_of(home)
    output = proc.stdout + proc.stderr
    assert "DP-SGD on cuda" in output, output[-4000:]
    report = json.loads((tmp_path / "gpu" / "privacy_report.json").read_text())
    assert sorted(n["tier"] for n in report["nodes"]) == ["strong", "weak"]


def test_the_gpu_preset_is_a_valid_run_config():
    import tomllib
    from pathlib import Path

    from common.config import RunConfig

    root = Path(__file__).resolve().parents[1]
    defaults = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    preset = tomllib.loads((root / "presets" / "gpu.toml").read_text())
    assert set(preset) <= set(defaults)  # only known keys: flwr would reject others
    cfg = RunConfig.from_flower({**defaults, **preset})
    assert cfg.batch_size == 256 and cfg.local_steps == 50 and cfg.generation_batch_size == 128
