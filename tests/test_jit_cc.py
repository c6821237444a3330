"""jittor's kernel compile command (backends/jittor/jit_cc.sh): a kernel without asm_tuner's
markers goes straight to the compiler, with jittor's common headers precompiled, everything
else to jittor's own wrapper; jittor compiles and runs a new kernel through it, and a kernel
compiles to the same code with the precompiled headers as without."""

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
JIT_CC = ROOT / "backends" / "jittor" / "jit_cc.sh"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="jittor's asm_tuner path is Linux-only")


def _recorder(path: Path, log: Path, body: str = "") -> str:
    """An executable that writes its arguments, one per line, to ``log`` (then runs ``body``)."""
    path.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{log}"\n{body}')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


# a fake compiler's body: it fails for a header and otherwise "writes" its -o file
_FAKE_CC = 'case "$*" in *c++-header*) [ -n "$PCH_FAILS" ] && exit 1 ;; esac\nprev=\nfor a do [ "$prev" = -o ] && : > "$a"; prev=$a; done\n'


def _run(tmp_path: Path, args: list[str], **env_extra: str) -> tuple[list[str], list[str]]:
    """Run the script with a fake compiler and a fake interpreter; what each received last."""
    cc_log, py_log = tmp_path / "cc.log", tmp_path / "py.log"
    for f in (cc_log, py_log):
        f.unlink(missing_ok=True)
    env = dict(os.environ, LORA_JITTOR_PYTHON=_recorder(tmp_path / "python", py_log), **env_extra)
    cc = _recorder(tmp_path / "c++", cc_log, _FAKE_CC)
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


def test_a_cpu_kernel_includes_the_precompiled_headers_built_once_into_the_cache(tmp_path):
    tuner = "/j/utils/asm_tuner.py"
    jsrc = tmp_path / "site" / "jittor" / "src"
    jsrc.mkdir(parents=True)
    (jsrc / "var.h").write_text("#pragma once\n")
    (tmp_path / "cache" / "jit").mkdir(parents=True)
    kernel = tmp_path / "cache" / "jit" / "k_op.cc"
    kernel.write_text('\n#define JIT 1\n#define JIT_cpu 1\n#include "var.h"\nint f() { return 1; }\n')
    so = str(tmp_path / "cache" / "jit" / "k_op.so")
    flags = [f"-I{jsrc}", "-Ofast", "-shared", "-L/x", "-l:y.so", "-Wl,-rpath,/x"]
    cc, py = _run(tmp_path, [tuner, str(kernel), *flags, "-o", so])
    built = list((tmp_path / "cache" / "lora_pch").glob("*/jt_kernel.h.gch"))
    assert len(built) == 1 and py == []
    header = built[0].with_suffix("")
    assert header.read_text() == (JIT_CC.parent / "pch" / "jt_kernel.h").read_text()
    assert cc == ["-include", str(header), str(kernel), *flags, "-o", so]
    # built once: the next kernel's only compiler call is its own
    built[0].write_bytes(b"kept")
    cc, _ = _run(tmp_path, [tuner, str(kernel), *flags, "-o", so])
    assert cc[:2] == ["-include", str(header)] and built[0].read_bytes() == b"kept"
    # other flags, another header; LORA_JITTOR_PCH=0 or a kernel jittor did not write as a CPU kernel: none
    cc, _ = _run(tmp_path, [tuner, str(kernel), *flags, "-O2", "-o", so])
    assert cc[:2] == ["-include", cc[1]] and cc[1] != str(header)
    assert len(list((tmp_path / "cache" / "lora_pch").glob("*/jt_kernel.h.gch"))) == 2
    cc, _ = _run(tmp_path, [tuner, str(kernel), *flags, "-o", so], LORA_JITTOR_PCH="0")
    assert cc == [str(kernel), *flags, "-o", so]
    # a kernel with markers: jittor's tuner, which compiles to assembly with -g, gets a header built with -g
    marked = tmp_path / "cache" / "jit" / "m_op.cc"
    marked.write_text(kernel.read_text() + '//@begin replace "vmova(.*)" "vmovnt\\g<1>"\n//@end\n')
    cc, py = _run(tmp_path, [tuner, str(marked), *flags, "-o", so])
    assert cc[-6:-3] == ["-g", "-x", "c++-header"]  # the header's build, the compiler's last call
    assert py[:5] == [tuner, f"--cc_path={tmp_path / 'c++'}", str(marked), "-include", py[4]] and py[5:] == [*flags, "-o", so]
    assert Path(py[4] + ".gch").is_file() and Path(py[4]).parent not in (header.parent, Path(cc[1]).parent)
    other = tmp_path / "cache" / "jit" / "c_op.cc"
    other.write_text('#define JIT 1\n#include "var.h"\nint f() { return 1; }\n')
    cc, _ = _run(tmp_path, [tuner, str(other), *flags, "-o", so])
    assert cc == [str(other), *flags, "-o", so]


def cpu_kernel_args(tmp_path) -> list[str]:
    """The command jittor's tuner path gives jit_cc.sh for a fake CPU kernel under ``tmp_path``."""
    jsrc = tmp_path / "jittor" / "src"
    jsrc.mkdir(parents=True)
    (tmp_path / "jit").mkdir()
    kernel = tmp_path / "jit" / "k_op.cc"
    kernel.write_text("#define JIT 1\n#define JIT_cpu 1\nint f() { return 1; }\n")
    return ["/j/utils/asm_tuner.py", str(kernel), f"-I{jsrc}", "-Ofast", "-o", str(tmp_path / "jit" / "k_op.so")]


def test_a_header_that_does_not_build_is_not_retried_and_the_kernel_compiles_without(tmp_path):
    args = cpu_kernel_args(tmp_path)
    for _ in range(2):
        cc, _ = _run(tmp_path, args, PCH_FAILS="1")
        assert cc == args[1:]
    (failed,) = (tmp_path / "lora_pch").glob("*/failed")
    assert not list(failed.parent.glob("*.gch")) and not list(failed.parent.glob("tmp.*"))


def test_kernels_compile_to_the_same_code_with_the_precompiled_headers(tmp_path):
    """jittor's own kernels of this run (a fused element-wise and reduction, a jt.code, a
    matmul, a kernel the tuner rewrites), compiled again by the command jittor recorded for
    each, with and without."""
    import lora_core as lc

    lc.get_backend("jittor")
    import jittor as jt

    from backends.jittor import _env, pch_check

    if not _env.use_direct_compile():
        pytest.skip("LORA_JITTOR_ASM_TUNER set: jittor's own path")
    if shutil.which("objcopy") is None:
        pytest.skip("no objcopy (binutils)")
    x = jt.array(np.arange(12, dtype=np.float32).reshape(3, 4))
    v = x.reshape(12)
    y = jt.code(v.shape, v.dtype, [v], cpu_src="for (int i=0; i<in0_shape0; i++) @out(i) = @in0(i) * 5.0f - 3.5f;")
    w = jt.array(np.random.default_rng(0).random((64, 128), dtype=np.float32))
    z = ((y.reshape(3, 4) * 2 + 1).sum(1), jt.matmul(x, x.transpose()), w * w[0] + w.exp())  # the last: a broadcast the tuner marks
    jt.sync(list(z))
    jit = Path(jt.flags.cache_path, "jit")
    wanted = {"code__": "* 5.0f - 3.5f;", "__opkey0_": "reduce_op.h", "mkl_matmul": "", "marked": "@begin"}
    picked = {}
    for key in sorted(jit.glob("*_op.so.key")):
        src = _src(key)
        if [ln for ln in src.splitlines() if ln.strip()][:2] != ["#define JIT 1", "#define JIT_cpu 1"]:
            continue
        for prefix, marker in wanted.items():
            if (key.name.startswith(prefix) or prefix == "marked") and marker in src and (prefix == "marked") == ("@begin" in src):
                picked.setdefault(prefix, key)
    assert {"code__", "__opkey0_", "marked"} <= set(picked), sorted(p.name for p in jit.glob("*_op.so.key"))
    for key in picked.values():
        assert Path(pch_check.recorded_command(key)[0]) == _env.JIT_CC
        texts, _ = pch_check.compile_both_ways(key, tmp_path, ("-Winvalid-pch",))  # raises on a header not used
        assert texts[0] == texts[1], key.name
    # one header per compiler flags (oneDNN's matmul adds its include folder; the tuner -g)
    assert 1 <= len(list((tmp_path / "jit" / "lora_pch").glob("*/jt_kernel.h.gch"))) <= len(picked)


def test_without_the_interpreter_variable_it_says_so(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "LORA_JITTOR_PYTHON"}
    r = subprocess.run([str(JIT_CC), "/j/utils/dlink_compiler.py"], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "LORA_JITTOR_PYTHON is not set" in r.stderr


def test_jittor_compiles_and_runs_a_kernel_through_it():
    import lora_core as lc

    lc.get_backend("jittor")
    import jittor as jt

    from backends.jittor import _env

    if not _env.use_direct_compile():
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
