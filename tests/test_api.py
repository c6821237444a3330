"""Both backends expose the same contract: same ``__all__``, same signatures (STYLE.md §1)."""

from __future__ import annotations

import inspect

import numpy as np

import lora_core as lc

MODULES = ("lora", "gpt2", "distilbert", "optim", "train", "generate", "distributed", "llama")


def _sig(f):
    """Names, kinds and defaults (annotations name framework types, so they may differ)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]


def _default(d) -> str:
    """A default by repr; a framework dtype (``torch.float32``, ``jittor.float32``) by its name."""
    if type(d).__module__ == "torch" and type(d).__name__ == "dtype":
        return "dtype " + str(d).removeprefix("torch.")
    if callable(d) and getattr(d, "__module__", None) == "jittor_core.ops" and d.__name__ in _JT_DTYPES:
        return "dtype " + d.__name__
    return repr(d)


_JT_DTYPES = {"bool", "int8", "int16", "int32", "int64", "uint8", "float16", "bfloat16", "float32", "float64"}


def _sig_repr(f):
    """``_sig`` with the defaults compared by ``_default``."""
    return [(p.name, p.kind, _default(p.default)) for p in inspect.signature(f).parameters.values()]


def _methods(cls) -> set:
    """A class's own public methods and ``__init__``."""
    return {m for m in _public(cls) if callable(getattr(cls, m, None)) and m in vars(cls)} | {"__init__"}


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


def _shared_modules() -> list[str]:
    """Every public module file present in both backends."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "backends"
    names = {p.stem for p in (root / "torch").glob("*.py")} & {p.stem for p in (root / "jittor").glob("*.py")}
    return sorted(n for n in names if not n.startswith("_"))


# Modules without an ``__all__`` in either backend: their public names reach users through the
# package's ``__all__``, which ``test_same_all_and_signatures`` compares.
NO_ALL = {"gpt2", "optim", "train"}

# Deliberate differences between a module's exported names, (module, name) -> why.
EXCEPTIONS: dict[tuple[str, str], str] = {
    # (none: every name in a shared module's __all__ has one signature in both backends)
}


def test_each_shared_module_exports_the_same_names_and_signatures():
    """For every module file present in both backends: the same ``__all__``, and each name in it
    with the same parameters (names, kinds, defaults by repr, a framework dtype default by its
    name) in both; for a class, each of its own public methods too (``forward`` is ``execute``).
    A deliberate difference is listed in ``EXCEPTIONS`` with its reason."""
    import importlib

    lc.get_backend("torch"), lc.get_backend("jittor")  # jittor configured before its modules import it
    modules = _shared_modules()
    assert {"quant", "lora", "train", "generate"} <= set(modules)
    problems = []
    for m in modules:
        a_mod, b_mod = (importlib.import_module(f"backends.{be}.{m}") for be in ("torch", "jittor"))
        a_all, b_all = getattr(a_mod, "__all__", None), getattr(b_mod, "__all__", None)
        if m in NO_ALL:
            assert a_all is None and b_all is None, f"{m}: has an __all__ now: take it off NO_ALL"
            continue
        if a_all is None or b_all is None:
            problems.append(f"{m}: __all__ torch {a_all}, jittor {b_all}")
            continue
        if sorted(a_all) != sorted(b_all):
            problems.append(f"{m}: __all__ differs: torch only {sorted(set(a_all) - set(b_all))}, "
                            f"jittor only {sorted(set(b_all) - set(a_all))}")
        for name in sorted(set(a_all) | set(b_all)):
            if (m, name) in EXCEPTIONS:
                continue
            if not (hasattr(a_mod, name) and hasattr(b_mod, name)):
                problems.append(f"{m}.{name}: missing in {'torch' if not hasattr(a_mod, name) else 'jittor'}")
                continue
            a, b = getattr(a_mod, name), getattr(b_mod, name)
            if inspect.isclass(a) != inspect.isclass(b) or callable(a) != callable(b):
                problems.append(f"{m}.{name}: a {type(a).__name__} in torch, a {type(b).__name__} in jittor")
            elif inspect.isclass(a):
                only_b = {"forward" if x == "execute" else x for x in _methods(b)} - _methods(a)
                problems += [f"{m}.{name}.{x}: missing in torch" for x in sorted(only_b)
                             if (m, f"{name}.{x}") not in EXCEPTIONS]
                for meth in sorted(_methods(a)):
                    mb = "execute" if meth == "forward" else meth
                    if (m, f"{name}.{meth}") in EXCEPTIONS:
                        continue
                    if not hasattr(b, mb):
                        problems.append(f"{m}.{name}.{mb}: missing in jittor")
                    elif _sig_repr(getattr(a, meth)) != _sig_repr(getattr(b, mb)):
                        problems.append(f"{m}.{name}.{meth}: torch {_sig_repr(getattr(a, meth))}, "
                                        f"jittor {_sig_repr(getattr(b, mb))}")
            elif callable(a):
                if _sig_repr(a) != _sig_repr(b):
                    problems.append(f"{m}.{name}: torch {_sig_repr(a)}, jittor {_sig_repr(b)}")
    assert not problems, "\n".join(problems)


def test_quant_dequantize_means_the_same_in_both_backends():
    """``quant.dequantize`` (an NF4 state's arrays -> its float32 weight) and
    ``LoRALinear4bit.dequantized(dtype)`` give the same values in both backends (and the spec's),
    with and without double quantization, for each compute dtype and each result dtype."""
    import torch

    lc.get_backend("jittor")
    import jittor as jt

    from backends.jittor import quant as jq
    from backends.torch import quant as tq
    from lora_core.quant.nf4 import dequantize_nf4, quantize_nf4

    w = np.random.default_rng(0).standard_normal((6, 128)).astype(np.float32)
    for double_quant in (True, False):
        st = quantize_nf4(w, 64, double_quant=double_quant)
        want = dequantize_nf4(st)
        t_layer = tq.LoRALinear4bit(st)
        t = tq.dequantize(t_layer.packed, t_layer.absmax, t_layer.nested_absmax, t_layer.offset, st.shape,
                          st.blocksize, st.nested_blocksize)
        j = jq.dequantize(st.packed, st.absmax, st.nested_absmax, st.offset, st.shape, st.blocksize,
                          st.nested_blocksize)
        assert np.array_equal(t.numpy(), want) and np.array_equal(j.numpy(), want), double_quant
        for compute in ("float32", "bfloat16"):
            for dtype in ("float32", "bfloat16"):
                a = tq.LoRALinear4bit(st, compute_dtype=compute).dequantized(getattr(torch, dtype))
                b = jq.LoRALinear4bit(st, compute_dtype=compute).dequantized(getattr(jt, dtype))
                assert str(a.dtype).removeprefix("torch.") == str(b.dtype) == dtype
                assert np.array_equal(a.float().numpy(), b.float32().numpy()), (double_quant, compute, dtype)


def _draws(backend, n: int = 6):
    """``n`` uniform draws of the backend's framework RNG (what dropout masks come from)."""
    if backend.NAME == "torch":
        import torch

        return torch.rand(n).numpy()
    import jittor as jt

    return jt.rand(n).numpy()


def test_manual_seed_takes_every_seed_torch_takes(backend):
    """The trainer seeds ``dropout_seed(seed, step) * world + rank`` before each update: past
    2**32 from ``--seed 4295`` on, which jittor's ``set_global_seed`` refused (training failed at
    step 0); negative seeds too. Each backend takes them, and one seed gives one sequence of draws."""
    from lora_core.train.data_order import dropout_seed

    for seed in (dropout_seed(4295, 0), 4295012885, 2**63 - 1, -1, -(2**40), 0, 7):
        backend.manual_seed(seed)
        first = _draws(backend)
        backend.manual_seed(seed)
        assert np.array_equal(first, _draws(backend)), seed
    backend.manual_seed(4295012885)
    a = _draws(backend)
    backend.manual_seed(4295012886)
    assert not np.array_equal(a, _draws(backend))  # nearby seeds, other draws
