"""Device placement for PyTorch (the ``--device`` option: ``lora_core.device``).

Contract (same in every backend): ``to_device(model, device="auto") -> str`` places the model
and returns the device it resolved to (``cpu`` or ``cuda:N``); batches, optimizer state and
beam-search caches follow the parameters. ``peak_gpu_mb(model)``: the framework's peak GPU
memory counter in MiB when the model is on a GPU, else ``None``; ``reset_peak_gpu(model)``
starts that counter again (the trainer calls it where a run starts, the benchmark where a
phase starts), so that a run reports its own peak, not the process's.
"""

from __future__ import annotations

import torch

from lora_core.device import resolve_device


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def to_device(model, device: str = "auto") -> str:
    """Move ``model`` to ``device`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``); returns where it went."""
    name = resolve_device(device, gpu_count(), "torch", "torch.cuda.is_available() is False")
    model.to(name)
    return name


def peak_gpu_mb(model) -> float | None:
    """``torch.cuda.max_memory_allocated`` of the model's GPU in MiB; ``None`` on the CPU."""
    dev = next(model.parameters()).device
    if dev.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(dev) / 2**20, 1)


def reset_peak_gpu(model) -> None:
    """``torch.cuda.reset_peak_memory_stats`` of the model's GPU (the peak becomes what is
    allocated now); nothing on the CPU."""
    dev = next(model.parameters()).device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


__all__ = ["peak_gpu_mb", "reset_peak_gpu", "to_device"]
