"""Captured training step: not for jittor (``set_compile`` contract in ``backends.torch.compile``).

Jittor has no ``torch.compile``; it already builds every step lazily as a graph of ops, fuses
them and compiles the fused kernels (cached by shape), so there is nothing to switch on.
"""

from __future__ import annotations


def set_compile(model, enabled: bool = True, backend: str = "inductor") -> None:
    """``True`` raises ``ValueError`` (see the module docstring); ``False`` changes nothing."""
    if enabled:
        raise ValueError("compile is not supported by the jittor backend: there is no torch.compile in jittor, "
                         "and jittor's own JIT already fuses and compiles each step's ops (cached per shape); "
                         "drop --compile, or use the torch backend")
    model.compiled_loss = None


__all__ = ["set_compile"]
