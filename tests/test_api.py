"""Both backends expose the same contract: same ``__all__``, same signatures (STYLE.md §1)."""

from __future__ import annotations

import inspect

import lora_core as lc

MODULES = ("lora", "gpt2", "distilbert", "optim", "train", "generate", "distributed", "llama")


def _sig(f):
    """Names, kinds and defaults (annotations name framework types, so they may differ)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]


def _public(obj):
    return {n for n in dir(obj) if not n.startswith("_")}


def test_same_all_and_signatures():
    bt, bj = lc.get_backend("torch"), lc.get_backend("jittor")
    assert bt.__all__ == bj.__all__
    for name in bt.__all__:
        a, b = getattr(bt, name), getattr(bj, name)
        if inspect.isclass(a):
            # the call itself is ``forward`` in torch and ``execute`` in jittor (framework idiom)
            methods = {m for m in _public(a) if callable(getattr(a, m, None)) and m in vars(a)} | {"__init__"}
            for m in sorted(methods):
                mb = "execute" if m == "forward" else m
                assert hasattr(b, mb), f"{name}.{mb} missing in jittor"
                assert _sig(getattr(a, m)) == _sig(getattr(b, mb)), f"{name}.{m}"
        elif callable(a):
            assert _sig(a) == _sig(b), name
        else:
            assert type(a) is type(b), name


def test_same_module_files():
    import importlib
    for m in MODULES:
        for be in ("torch", "jittor"):
            importlib.import_module(f"backends.{be}.{m}")
