"""The environment variables the commands and the library read: a bad value is refused naming the
variable (at the commands' start, not mid-run), on/off switches take the usual words, and
LORA_ALLOCATOR=tcmalloc without tcmalloc says so on stderr and runs under glibc's malloc."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from lora_core.quant import nf4
from lora_core.train import allocator, heap

ROOT = Path(__file__).resolve().parents[1]
BAD_MALLOC = [("LORA_ALLOCATOR", "jemalloc"), ("LORA_MALLOC_TRIM", "yes"), ("LORA_MALLOC_TRIM_EVERY", "0"),
              ("LORA_MALLOC_TRIM_EVERY", "\u00b2")]


def _jittor_env():
    """backends/jittor/_env.py alone: importing the package would import jittor."""
    spec = importlib.util.spec_from_file_location("_lora_jittor_env", ROOT / "backends" / "jittor" / "_env.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("var,value", BAD_MALLOC)
def test_the_bench_refuses_a_bad_malloc_variable_before_any_work(monkeypatch, capsys, var, value):
    from examples.lm import bench

    monkeypatch.setenv(var, value)
    monkeypatch.setattr(bench, "gemm_peak", lambda *a: pytest.fail("the bench ran before refusing " + var))
    with pytest.raises(SystemExit) as e:
        bench.main(["--systems", "ours-torch"])
    assert e.value.code == 2 and f"{var}={value!r}" in capsys.readouterr().err


@pytest.mark.parametrize("var,value", BAD_MALLOC)
def test_lm_train_refuses_a_bad_malloc_variable_before_any_work(monkeypatch, capsys, tmp_path, var, value):
    from examples.lm import train

    monkeypatch.setenv(var, value)
    monkeypatch.setattr(train, "run_job", lambda body: pytest.fail("the run started before refusing " + var))
    with pytest.raises(SystemExit) as e:
        train.main(["--prepared", str(tmp_path), "--random-init", train.RANDOM_PRESETS[0], "--out-dir", str(tmp_path / "o")])
    assert e.value.code == 2 and f"{var}={value!r}" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "eight", "-8", "\u00b2", "4.0"])
def test_sum_lanes_must_be_a_positive_integer(monkeypatch, value):
    monkeypatch.setenv("LORA_CORE_TORCH_SUM_LANES", value)
    with pytest.raises(ValueError, match=r"LORA_CORE_TORCH_SUM_LANES=.*positive integer.*need not divide"):
        nf4.cpu_lanes()


def test_sum_lanes_any_positive_count_need_divide_nothing(monkeypatch):
    monkeypatch.delenv("LORA_CORE_TORCH_SUM_LANES", raising=False)
    assert nf4.cpu_lanes() == 8
    x = np.random.default_rng(0).standard_normal(1001).astype(np.float32)  # a size no lane count below divides
    for lanes in ("3", " 7 ", "16", "2000"):
        monkeypatch.setenv("LORA_CORE_TORCH_SUM_LANES", lanes)
        assert nf4.cpu_lanes() == int(lanes)
        assert abs(float(nf4._torch_sum(x)) - float(x.astype(np.float64).sum())) < 1e-3
    monkeypatch.setenv("LORA_CORE_TORCH_SUM_LANES", "")
    assert nf4.cpu_lanes() == 8


@pytest.mark.parametrize("value", ["\u00b2", "\u0663", "0", "x"])  # superscript two, Arabic-Indic three: isdigit() takes them
def test_counts_given_in_unicode_digits_are_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("LORA_QUANT_WORKERS", value)
    with pytest.raises(ValueError, match="LORA_QUANT_WORKERS="):
        nf4.quant_workers()
    monkeypatch.setenv("LORA_CORE_TORCH_THREADS", value)
    with pytest.raises(ValueError, match="LORA_CORE_TORCH_THREADS="):
        nf4.absmax_offset(np.ones(4, np.float32))
    with pytest.raises(ValueError, match="LORA_MALLOC_TRIM_EVERY="):
        heap.parse_stride(value, "LORA_MALLOC_TRIM_EVERY")
    monkeypatch.setenv("LORA_MALLOC_TRIM_EVERY", value)
    with pytest.raises(ValueError, match="LORA_MALLOC_TRIM_EVERY="):
        heap.every()


def test_counts_still_read(monkeypatch):
    monkeypatch.setenv("LORA_QUANT_WORKERS", " 3 ")
    monkeypatch.setenv("LORA_CORE_TORCH_THREADS", "2")
    assert nf4.quant_workers() == 3 and nf4.absmax_offset(np.ones(4, np.float32)) == 1
    assert heap.parse_stride("12", "x") == 12


def _relaunch(monkeypatch, mode):
    monkeypatch.setenv("LORA_ALLOCATOR", mode)
    monkeypatch.delenv(allocator.RELAUNCHED, raising=False)
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda dirs=None: None)
    monkeypatch.setattr(allocator, "active", lambda maps=None: "glibc")
    monkeypatch.setattr(allocator.os, "execve", lambda *a: pytest.fail("relaunched without tcmalloc"))
    allocator.relaunch("llama", ["python", "-m", "x"])


def test_tcmalloc_asked_for_and_not_found_warns_and_runs_under_glibc(monkeypatch, capsys):
    _relaunch(monkeypatch, "tcmalloc")
    err = capsys.readouterr().err
    assert "LORA_ALLOCATOR=tcmalloc" in err and "not found" in err and "libtcmalloc-minimal4" in err
    _relaunch(monkeypatch, "auto")  # the default says nothing: glibc where tcmalloc is not installed
    assert capsys.readouterr().err == ""


def test_the_bench_warns_when_tcmalloc_is_asked_for_and_not_found(monkeypatch, capsys):
    from examples.lm import bench

    monkeypatch.setenv("LORA_ALLOCATOR", "tcmalloc")
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda dirs=None: None)

    class Stop(Exception):
        pass

    monkeypatch.setattr(bench, "_shape", lambda *a: (_ for _ in ()).throw(Stop()))
    with pytest.raises(Stop):
        bench.main(["--systems", "ours-torch"])
    assert "LORA_ALLOCATOR=tcmalloc, but tcmalloc was not found" in capsys.readouterr().err


@pytest.mark.parametrize("var", ["LORA_JITTOR_ASM_TUNER", "LORA_JITTOR_PCH"])
def test_jittor_switches_take_on_off_words_and_refuse_others(monkeypatch, var):
    env = _jittor_env()
    for value, on in [("0", False), ("off", False), ("FALSE", False), (" No ", False),
                      ("1", True), ("On", True), ("true", True), ("yes", True)]:
        monkeypatch.setenv(var, value)
        assert env.switch(var) is on, value
    monkeypatch.setenv(var, "")
    assert env.switch(var) is env.SWITCHES[var]
    monkeypatch.delenv(var)
    assert env.switch(var) is env.SWITCHES[var]
    monkeypatch.setenv(var, "maybe")
    with pytest.raises(ValueError, match=f"{var}='maybe'"):
        env.switch(var)
    with pytest.raises(ValueError, match=var):  # setting up the backend refuses it before jittor compiles anything
        env.configure()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="jit_cc.sh: Linux only")
def test_jit_cc_turns_the_precompiled_header_off_with_the_same_words(tmp_path):
    from test_jit_cc import _run, cpu_kernel_args

    args = cpu_kernel_args(tmp_path)
    for value in ("0", "off", "OFF", "False", " no "):
        cc, _ = _run(tmp_path, args, LORA_JITTOR_PCH=value)
        assert cc == args[1:], value  # the kernel's own compile, no -include
    for value in ("1", "on", "TRUE", "yes", ""):
        cc, _ = _run(tmp_path, args, LORA_JITTOR_PCH=value)
        assert cc[0] == "-include", value
