"""The ``--device`` option, framework-agnostic: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.

``auto`` is the backend's first GPU when it has one, else the CPU. Asking for a GPU the
backend does not have is one ``ValueError`` naming the option, what the backend sees and the
choices. A backend's ``to_device(model, device)`` resolves the string with
:func:`resolve_device` and places the model; batches, optimizer state and beam-search caches
follow the parameters' device, and checkpoints stay numpy (device-independent).
"""

from __future__ import annotations

import re

__all__ = ["DEVICE_CHOICES", "parse_device", "resolve_device"]

DEVICE_CHOICES = "auto, cpu, cuda, cuda:N"


def parse_device(text, option: str = "device") -> tuple[str, int | None]:
    """``(kind, index)``: kind ``auto``/``cpu``/``cuda``; index the N of ``cuda:N`` (else None)."""
    m = re.fullmatch(r"(auto|cpu|cuda)(?::(\d+))?", text.strip().lower()) if isinstance(text, str) else None
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise ValueError(f"{option}={text!r} is not a device; choose one of {DEVICE_CHOICES}")
    return m.group(1), None if m.group(2) is None else int(m.group(2))


def resolve_device(text, gpu_count: int, backend: str, why_none: str = "", option: str = "device") -> str:
    """``cpu`` or ``cuda:N`` for ``text`` on a backend that sees ``gpu_count`` GPUs.

    Args:
        text: the option's value (``auto``, ``cpu``, ``cuda``, ``cuda:N``).
        gpu_count: GPUs the backend can use.
        backend: its name, for the error message.
        why_none: what the backend reported when it sees no GPU (for the error message).
        option: the option's name, for the error message.
    """
    kind, index = parse_device(text, option)
    if kind == "cpu" or (kind == "auto" and gpu_count == 0):
        return "cpu"
    if kind == "auto":
        return "cuda:0"
    if gpu_count == 0:
        reason = f" ({why_none})" if why_none else ""
        raise ValueError(f"{option}={text!r}: the {backend} backend sees no CUDA GPU here{reason}; "
                         f"choose one of {DEVICE_CHOICES} (auto and cpu run on the CPU)")
    index = index or 0
    if index >= gpu_count:
        raise ValueError(f"{option}={text!r}: the {backend} backend sees {gpu_count} GPU(s), cuda:0 to "
                         f"cuda:{gpu_count - 1}; choose one of {DEVICE_CHOICES}")
    return f"cuda:{index}"
