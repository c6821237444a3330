"""The GPU self-check: its numbers, and the error a broken jittor-on-CUDA gives (faked here:
CI has no GPU); the real GPU run is marked ``gpu`` and skipped without one."""

import stat

import numpy as np
import pytest

from lora_core.gpu_check import GPUSelfCheckError, check_results, cuda_toolkit, expected_results, self_check_inputs
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
    from backends.jittor import distilbert, inject, model

    def failing(*_, **__):
        raise GPUSelfCheckError("faked: jittor returned wrong numbers")

    for module, name in ((bj, "_ensure_gpu_ok"), (inject, "ensure_gpu_ok"), (distilbert, "ensure_gpu_ok"),
                         (model, "ensure_gpu_ok")):  # fmt: skip
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


@pytest.mark.gpu
def test_jittor_on_cuda_is_checked_before_model_work():
    from backends.jittor._env import cuda_driver_present

    if not cuda_driver_present():
        pytest.skip("no NVIDIA GPU")
    import lora_core as lc

    bj = lc.get_backend("jittor")
    import jittor as jt

    jt.flags.use_cuda = 1
    cfg = lc.gpt2_config("tiny-32")
    try:
        bj.build_model(cfg, None, lc.init_gpt2_weights(cfg))
    except GPUSelfCheckError as e:  # allowed: a broken toolkit must say so, not compute garbage
        assert "CUDA toolkit found" in str(e)
    finally:
        jt.flags.use_cuda = 0
