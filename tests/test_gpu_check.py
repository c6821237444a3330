"""The GPU self-check: its numbers, and the error a broken jittor-on-CUDA gives (faked here:
CI has no GPU); the real GPU run is marked ``gpu`` and skipped without one."""

import os
import stat
import sys

import numpy as np
import pytest

from lora_core import gpu_check
from lora_core.gpu_check import (
    JITTOR_CUDA_SUPPORTED,
    GPUSelfCheckError,
    check_results,
    cuda_driver_present,
    cuda_toolkit,
    expected_results,
    self_check_inputs,
)
from lora_core.models.distilbert import PRESETS


def test_check_results_accepts_numpy_and_names_what_is_wrong():
    x = self_check_inputs()
    good = {k: v.astype(np.float32) for k, v in expected_results(x).items()}
    assert check_results(good, x) == []
    bad = dict(good, ones_times_2_sum=np.float32(0.96), matmul=good["matmul"][:2])
    problems = check_results(bad, x)
    assert len(problems) == 2 and problems[0].startswith("ones_times_2_sum: relative error"), problems
    assert "matmul: shape" in problems[1]


def _fake_nvcc(tmp_path, release="13.0"):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.48'\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    return str(nvcc)


def test_cuda_toolkit_names_version_and_path(tmp_path, monkeypatch):
    nvcc = _fake_nvcc(tmp_path)
    monkeypatch.setenv("nvcc_path", nvcc)
    assert cuda_toolkit() == f"CUDA 13.0 ({nvcc})"


def test_jittor_self_check_passes_on_cpu_and_fails_clearly_when_faked(tmp_path, monkeypatch):
    from lora_core import get_backend

    get_backend("jittor")
    from backends.jittor import _gpu_check

    _gpu_check.ensure_gpu_ok(force=True)  # jittor's real numbers on this CPU agree with numpy
    monkeypatch.setenv("nvcc_path", _fake_nvcc(tmp_path))
    wrong = lambda x: dict(_gpu_check.compute(x), ones_times_2_sum=np.float32(0.96))  # what CUDA 13 returned
    with pytest.raises(GPUSelfCheckError) as e:
        _gpu_check.ensure_gpu_ok(force=True, compute=wrong)
    msg = str(e.value)
    assert "wrong numbers: ones_times_2_sum" in msg and "CUDA 13.0" in msg and "CUDA 10.x to 12.2" in msg, msg

    def crash(_):
        raise RuntimeError("nvcc fatal: Unsupported gpu architecture")

    with pytest.raises(GPUSelfCheckError, match="RuntimeError: nvcc fatal"):
        _gpu_check.ensure_gpu_ok(force=True, compute=crash)


def test_every_jittor_model_entry_point_runs_the_self_check_first(tmp_path, monkeypatch):
    """A failing self-check stops each way of making a jittor model before any model work
    (the missing checkpoint would otherwise be the error): the models' constructors, and the
    loaders before they read a checkpoint."""
    import lora_core as lc

    bj = lc.get_backend("jittor")
    from backends.jittor import distilbert, gpt2, inject

    def failing(*_, **__):
        raise GPUSelfCheckError("faked: jittor returned wrong numbers")

    for module, name in ((bj, "_ensure_gpu_ok"), (inject, "ensure_gpu_ok"), (distilbert, "ensure_gpu_ok"),
                         (gpt2, "ensure_gpu_ok")):  # fmt: skip
        monkeypatch.setattr(module, name, failing)
    cfg = lc.gpt2_config("tiny-32")
    missing = tmp_path / "no-such-checkpoint"
    calls = {
        "GPT2LMModel": lambda: bj.GPT2LMModel(cfg),
        "DistilBertForSequenceClassification": lambda: bj.DistilBertForSequenceClassification(PRESETS["tiny"]),
        "build_model": lambda: bj.build_model(cfg, None, lc.init_gpt2_weights(cfg)),
        "from_pretrained": lambda: bj.from_pretrained(missing),
        "distilbert_from_pretrained": lambda: bj.distilbert_from_pretrained(missing),
        "inject_lora": lambda: bj.inject_lora(None, None),
    }
    for what, call in calls.items():
        with pytest.raises(GPUSelfCheckError, match="faked"):
            call()
        print(what, "checked first")


def _no_toolkit_here(monkeypatch, tmp_path) -> None:
    """No nvcc anywhere jittor looks: not in $nvcc_path, on PATH, at the usual places, nor a
    toolkit jittor's installer put in its home."""
    monkeypatch.delenv("nvcc_path", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setattr(gpu_check, "NVCC_PLACES", (str(tmp_path / "usr-local-cuda-bin-nvcc"),))
    monkeypatch.setenv("JITTOR_HOME", str(tmp_path / "jittor-home"))


def test_a_driver_without_a_toolkit_sets_jittor_up_for_the_cpu(tmp_path, monkeypatch):
    """Issue 25: with a driver and no toolkit, jittor's import would download one (offline:
    fail); ``configure`` sets ``nvcc_path=""`` and keeps the reason for the self-check's
    message. A toolkit on PATH, or one jittor installed itself, is left to jittor; no driver
    means the CPU, with no reason to give."""
    from backends.jittor import _env

    _no_toolkit_here(monkeypatch, tmp_path)
    monkeypatch.setattr(_env, "cuda_driver_present", lambda: True)
    monkeypatch.setattr(_env, "no_cuda_reason", None)
    _env.configure()
    assert os.environ["nvcc_path"] == "" and "no CUDA toolkit was found" in _env.no_cuda_reason
    assert cuda_toolkit().startswith("none (no nvcc")

    for where in ("path", "jtcuda"):
        monkeypatch.delenv("nvcc_path", raising=False)
        monkeypatch.setattr(_env, "no_cuda_reason", None)
        folder = tmp_path / "bin" if where == "path" else tmp_path / "jittor-home/.cache/jittor/jtcuda/cuda12.2/bin"
        folder.mkdir(parents=True)
        nvcc = _fake_nvcc(folder, "12.2")
        if where == "path":
            monkeypatch.setenv("PATH", str(folder))
            assert cuda_toolkit() == f"CUDA 12.2 ({nvcc})"
        _env.configure()
        assert "nvcc_path" not in os.environ and _env.no_cuda_reason is None, where
        os.remove(nvcc)

    monkeypatch.setattr(_env, "cuda_driver_present", lambda: False)
    _env.configure()
    assert os.environ["nvcc_path"] == "" and _env.no_cuda_reason is None


def test_jittor_compiles_kernels_in_the_calling_thread(monkeypatch):
    """jittor's compile threads race (CI crashed in them with 8 threads and with 2):
    ``configure`` defaults ``use_parallel_op_compiler`` to 1, where jittor compiles inline,
    keeps the user's, and jittor honours the environment variable."""
    from lora_core import get_backend

    get_backend("jittor")
    import jittor as jt

    from backends.jittor import _env

    at_import = os.environ.get("use_parallel_op_compiler")  # configure's default, or the user's own
    assert at_import is not None
    monkeypatch.delenv("use_parallel_op_compiler", raising=False)
    _env.configure()
    assert os.environ["use_parallel_op_compiler"] == "1" == str(_env.COMPILE_THREADS)
    monkeypatch.setenv("use_parallel_op_compiler", "3")
    _env.configure()
    assert os.environ["use_parallel_op_compiler"] == "3"
    # this process imported jittor through the backend: its flag is the variable's value
    assert jt.flags.use_parallel_op_compiler == int(at_import)


def test_asking_a_jittor_without_cuda_for_the_gpu_gives_the_self_check_error(tmp_path, monkeypatch):
    """Issue 25: on a machine with a driver, a jittor without CUDA (this one is built for the
    CPU) asked for the GPU raises the self-check's error (the toolkit found, the versions jittor
    supports, why), not "no GPU here", and not jittor's "No CUDA found" from setting
    ``use_cuda``, which stays off."""
    import lora_core as lc

    bj = lc.get_backend("jittor")
    import jittor as jt

    from backends.jittor import _env, device

    monkeypatch.setattr(device, "cuda_driver_present", lambda: True)  # a driver (faked)
    cfg = lc.gpt2_config("tiny-32")
    model = bj.build_model(cfg, None, lc.init_gpt2_weights(cfg))
    _no_toolkit_here(monkeypatch, tmp_path)
    monkeypatch.setattr(_env, "no_cuda_reason", "no CUDA toolkit was found, so ...")  # as configure leaves it
    with pytest.raises(GPUSelfCheckError) as e:
        bj.to_device(model, "cuda")
    msg = str(e.value)
    assert "this jittor has no CUDA: no CUDA toolkit was found" in msg and "CUDA toolkit found: none (no nvcc" in msg
    assert JITTOR_CUDA_SUPPORTED in msg and jt.flags.use_cuda == 0, msg
    monkeypatch.setattr(_env, "no_cuda_reason", None)  # e.g. nvcc_path="" set by the user, a CUDA 13 toolkit installed
    monkeypatch.setenv("nvcc_path", _fake_nvcc(tmp_path, "13.0"))
    with pytest.raises(GPUSelfCheckError, match=r"built without nvcc \(nvcc_path empty\)(.|\n)*found: CUDA 13\.0"):
        bj.to_device(model, "cuda:0")
    assert bj.to_device(model, "cpu") == "cpu" and jt.flags.use_cuda == 0


def test_a_crashing_jittor_import_on_a_driver_gives_the_self_check_error(tmp_path, monkeypatch):
    """``get_backend("jittor")`` can itself raise the self-check's error: an import that
    crashes (jittor compiling its CUDA sources against an unsupported toolkit) on a machine
    with a driver says so, with the same two facts."""
    from backends.jittor import _env

    monkeypatch.setattr(_env, "cuda_driver_present", lambda: True)
    monkeypatch.setenv("nvcc_path", _fake_nvcc(tmp_path, "13.0"))
    monkeypatch.setitem(sys.modules, "jittor", None)  # the import fails
    with pytest.raises(GPUSelfCheckError, match="importing jittor failed: ModuleNotFoundError") as e:
        _env.import_jittor()
    assert "CUDA toolkit found: CUDA 13.0" in str(e.value) and JITTOR_CUDA_SUPPORTED in str(e.value)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_driver_present(), reason="no NVIDIA GPU")
def test_jittor_on_cuda_is_checked_before_model_work():
    """With an NVIDIA driver, jittor on the GPU either passes its self-check (a model is built
    and runs there) or stops with the self-check's one message, wherever it is raised: the
    import (``get_backend``: a toolkit its CUDA sources do not compile with), ``to_device``
    (a jittor without CUDA: built without nvcc, or no toolkit found) or the first model on the
    GPU (wrong numbers)."""
    import lora_core as lc

    cfg, jt = lc.gpt2_config("tiny-32"), None
    try:
        bj = lc.get_backend("jittor")
        import jittor as jt

        model = bj.build_model(cfg, None, lc.init_gpt2_weights(cfg))
        assert bj.to_device(model, "cuda") == "cuda:0" and jt.flags.use_cuda == 1
        model = bj.build_model(cfg, None, lc.init_gpt2_weights(cfg))
        logits = model(np.array([[1, 2, 3]]))[0].numpy()
        assert logits.shape == (1, 3, cfg.vocab_size) and np.isfinite(logits).all()
    except GPUSelfCheckError as e:  # allowed: a GPU jittor cannot use must say so, not compute garbage
        msg = str(e)
        assert "CUDA toolkit found" in msg and JITTOR_CUDA_SUPPORTED in msg, msg
    finally:
        if jt is not None:
            jt.flags.use_cuda = 0
