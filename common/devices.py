"""Where models run and how their inputs get there: the one helper every model call uses.

- ``model_device`` / ``to_device``: move a batch (a tensor, a mapping or a sequence of
  tensors, a ``BatchEncoding``) to the device of a model's parameters. Every place that
  feeds a model (training, held-out loss, generation, the evaluation classifier) calls it,
  so no path can mix CPU inputs with a CUDA model.
- ``default_device``: ``cuda`` when this process can see a GPU, else ``cpu``.
- ``gpu_on_machine``: whether the *machine* has an NVIDIA GPU, even when this process
  cannot see it (Ray hides GPUs from ClientApps whose federation gives them none).
- ``client_resources``: the simulation resources that let ClientApps see the GPUs.
- ``native_bf16`` / ``autocast``: bf16 mixed precision only where the hardware computes it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch


def default_device() -> str:
    """``"cuda"`` when this process can use a GPU, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def to_device(batch: Any, device: torch.device | str | torch.nn.Module) -> Any:
    """``batch`` with every tensor moved to ``device`` (or to a model's device).

    A tensor, a ``BatchEncoding`` (its own ``.to``), a mapping (returned as a dict), a list
    or a tuple (returned as the same kind) is moved recursively; anything else is returned
    unchanged.
    """
    if isinstance(device, torch.nn.Module):
        device = model_device(device)
    device = torch.device(device)
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if type(batch).__name__ == "BatchEncoding":
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


@lru_cache(maxsize=1)
def gpu_on_machine() -> int:
    """Number of NVIDIA GPUs on the machine, whether or not this process may use them.

    Read from the driver (``/proc/driver/nvidia/gpus``, then ``nvidia-smi -L``), not from
    CUDA: ``CUDA_VISIBLE_DEVICES=""`` (what Ray sets for a ClientApp without GPU resources)
    hides GPUs from torch but not from the driver.
    """
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir():
        return len([p for p in gpus.iterdir() if p.is_dir()])
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            return 0
        return sum(line.startswith("GPU ") for line in out.splitlines())
    return 0


def hidden_gpu_warning() -> str | None:
    """A message naming the fix when the machine has a GPU this process cannot see, else None."""
    if torch.cuda.is_available() or not gpu_on_machine():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (f"this machine has {gpu_on_machine()} GPU(s) but this ClientApp cannot see any "
            f"(CUDA_VISIBLE_DEVICES={visible!r}), so DP-SGD runs on the CPU. In simulation, start with "
            "`fedsyn run .` (it gives ClientApps the GPUs) or pass "
            "--federation-config \"client-resources-num-gpus=0.5 client-resources-num-cpus=4\" to `flwr run`")


def client_resources(num_gpus: int, num_cpus: int, clients_per_gpu: int = 2) -> dict[str, float]:
    """Ray resources per simulated ClientApp so that ``clients_per_gpu`` share each GPU.

    Returns ``{"client-resources-num-gpus": g, "client-resources-num-cpus": c}`` (Flower's
    federation-config keys); no GPU gives ``{}`` (Flower's defaults).
    """
    if num_gpus <= 0:
        return {}
    clients = max(1, num_gpus * clients_per_gpu)
    return {"client-resources-num-gpus": round(1.0 / clients_per_gpu, 3),
            "client-resources-num-cpus": max(1, num_cpus // clients)}


@lru_cache(maxsize=4)
def native_bf16(device_type: str) -> bool:
    """Whether ``device_type`` ("cuda" or "cpu") computes bf16 matmuls in hardware.

    CUDA: ``torch.cuda.is_bf16_supported()`` (Ampere and later). CPU: the ``avx512_bf16`` or
    ``amx_bf16`` flag in ``/proc/cpuinfo``. Without them bf16 is emulated: on this project's
    AVX2-only EPYC a bf16 matmul runs at 0.3 GFLOP/s against 173 in fp32 (benchmarks/README.md).
    """
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


def uses_bf16(device: torch.device | str | torch.nn.Module, precision: str = "auto") -> bool:
    """Whether ``autocast(device, precision)`` computes in bf16: ``precision`` "auto" on a device
    with native bf16."""
    if isinstance(device, torch.nn.Module):
        device = model_device(device)
    return precision == "auto" and native_bf16(torch.device(device).type)


def autocast(device: torch.device | str | torch.nn.Module, precision: str = "auto"):
    """A bf16 ``torch.autocast`` on ``device`` when ``precision`` is "auto" and the device has
    native bf16; otherwise a no-op context (fp32)."""
    if isinstance(device, torch.nn.Module):
        device = model_device(device)
    if uses_bf16(device, precision):
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
