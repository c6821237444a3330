"""jittor's kernel compile command (backends/jittor/jit_cc.sh): a kernel without asm_tuner's
markers goes straight to the compiler, everything else to jittor's own wrapper, and jittor
compiles and runs a new kernel through it."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
JIT_CC = ROOT / "backends" / "jittor" / "jit_cc.sh"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="jittor's asm_tuner path is Linux-only")


def _recorder(path: Path, log: Path) -> str:
    """An executable that writes its arguments, one per line, to ``log``."""
    path.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{log}"\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _run(tmp_path: Path, args: list[str]) -> tuple[list[str], list[str]]:
    """Run the script with a fake compiler and a fake interpreter; what each received."""
    cc_log, py_log = tmp_path / "cc.log", tmp_path / "py.log"
    for f in (cc_log, py_log):
        f.unlink(missing_ok=True)
    env = dict(os.environ, LORA_JITTOR_PYTHON=_recorder(tmp_path / "python", py_log))
    cc = _recorder(tmp_path / "c++", cc_log)
    subprocess.run([str(JIT_CC), args[0], f"--cc_path={cc}", *args[1:]], env=env, check=True)
    read = lambda f: f.read_text().splitlines() if f.exists() else []  # noqa: E731
    return read(cc_log), read(py_log)


def test_kernel_without_markers_goes_to_the_compiler_the_rest_to_jittors_wrapper(tmp_path):
    tuner = "/j/utils/asm_tuner.py"
    plain, marked = tmp_path / "a b_op.cc", tmp_path / "m_op.cc"  # a space in the path survives
    plain.write_text("int f() { return 1; }\n")
    marked.write_text('//@begin replace "vmova(.*)" "vmovnt\\g<1>"\nint f() { return 1; }\n//@end\n')
    so = str(tmp_path / "a b_op.so")
    cc, py = _run(tmp_path, [tuner, str(plain), "-Ofast", "-o", so])
    assert cc == [str(plain), "-Ofast", "-o", so] and py == []
    cc, py = _run(tmp_path, [tuner, str(marked), "-Ofast", "-o", str(tmp_path / "m_op.so")])
    assert cc == [] and py[0] == tuner and py[1].startswith("--cc_path=") and py[2:] == [str(marked), "-Ofast", "-o", str(tmp_path / "m_op.so")]
    # the tuner's other forms (to assembly, from assembly) and CUDA's linker wrapper: unchanged
    cc, py = _run(tmp_path, [tuner, str(plain), "-S", "-o", str(tmp_path / "a_op.s")])
    assert cc == [] and py[0] == tuner
    cc, py = _run(tmp_path, ["/j/utils/dlink_compiler.py", "nvcc", "x.cu"])
    assert cc == [] and py[0] == "/j/utils/dlink_compiler.py"


def test_without_the_interpreter_variable_it_says_so(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "LORA_JITTOR_PYTHON"}
    r = subprocess.run([str(JIT_CC), "/j/utils/dlink_compiler.py"], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "LORA_JITTOR_PYTHON is not set" in r.stderr


def test_jittor_compiles_and_runs_a_kernel_through_it():
    import lora_core as lc

    lc.get_backend("jittor")
    import jittor as jt

    from backends.jittor import _env

    if os.environ.get("LORA_JITTOR_ASM_TUNER", "0") not in ("0", ""):
        pytest.skip("LORA_JITTOR_ASM_TUNER set: jittor's own path")
    assert jt.flags.python_path == str(_env.JIT_CC) and os.environ["LORA_JITTOR_PYTHON"]
    x = jt.array(np.arange(6, dtype=np.float32))
    # a kernel of its own (its source is its cache key): compiled through the script once per cache
    y = jt.code(x.shape, x.dtype, [x], cpu_src="for (int i=0; i<in0_shape0; i++) @out(i) = @in0(i) * 3.0f + 17.25f;")
    np.testing.assert_array_equal(y.numpy(), np.arange(6, dtype=np.float32) * 3 + 17.25)
    keys = [p for p in Path(jt.flags.cache_path, "jit").glob("code__*.so.key") if "* 3.0f + 17.25f;" in _src(p)]
    assert keys and all(str(_env.JIT_CC) in p.read_text().splitlines()[0] for p in keys)


def _src(key: Path) -> str:
    cc = key.with_name(key.name[: -len(".so.key")] + ".cc")
    return cc.read_text() if cc.exists() else ""
