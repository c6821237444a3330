"""Backend selector: ``get_backend("torch" | "jittor")`` imports ``backends.<name>`` lazily.

The name comes from the argument, else the ``LORA_BACKEND`` environment variable, else
``torch``. Nothing here imports a framework until it is asked for (as einops does).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

BACKENDS = ("torch", "jittor")


def get_backend(name: str | None = None) -> ModuleType:
    """Return the backend module ``backends.<name>``.

    Args:
        name: ``"torch"`` or ``"jittor"``; default ``$LORA_BACKEND`` or ``"torch"``.

    Raises:
        ValueError: the name is not a backend (the message lists the valid choices).
    """
    name = name or os.environ.get("LORA_BACKEND") or "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
    return importlib.import_module(f"backends.{name}")
