"""Configure jittor before its first import (no CUDA runtime or toolkit -> CPU; quiet logs).

jittor looks for ``nvcc`` at import and, when it finds one (e.g. a CUDA toolkit on a
machine without a GPU driver), fails loading ``libcudart``; when it finds none on a machine
with a driver, its import downloads a CUDA toolkit (jittor_utils/install_cuda.py: gigabytes,
and offline it fails). So we set ``nvcc_path=""`` (jittor builds its CPU path) when there is
no NVIDIA driver, or a driver but no toolkit (``no_cuda_reason`` says so, and asking for the
GPU then raises the self-check's error naming it, ``_gpu_check.require_cuda``). A user who
sets ``nvcc_path``, or has a driver and a toolkit (or one jittor installed itself:
``python -m jittor_utils.install_cuda``), gets jittor's CUDA path unchanged. oneDNN (jittor's
fast CPU matmul) is provided by the install step (``scripts/link_onednn.sh``), not here.

jittor compiles the kernels a run needs on first use, in ``use_parallel_op_compiler``
threads (its default: 16, capped at one per 3 GB of RAM: 8 on a 2-core, 24 GB machine). Those
threads race: each runs jittor's code generation and kernel loading (``OpCompiler::do_compile``)
on shared state, and the lock around it is a file lock, which threads of one process share. CI
crashed in them twice, "Segfault happen, main thread exit" with 8 threads on a fresh kernel
cache (a653611), and a segfault in thread 'C1' with 2 threads in a run whose kernels were all
cached (tests/test_train.py's killed run, at 822c856). We default it to 1: jittor then compiles
in the calling thread (``launch_all`` runs the work inline), no race. It costs time on a fresh
cache only (the first compile of the no-torch test's 89 kernels: 177 s with 1 thread, 95 s
with 2); cached kernels load as fast. A user's own ``use_parallel_op_compiler`` is kept.

Each CPU kernel goes through jittor's ``utils/asm_tuner.py`` (a Python start, a compile to
assembly, a rewrite of the lines its ``use_movnt`` pass marks, an assembly); we point
``jittor.flags.python_path`` at ``jit_cc.sh``, which compiles a kernel without such marks in
one compiler run (the same code; 1.49 vs 2.07 s per kernel here) and hands everything else to
jittor's own wrapper. ``LORA_JITTOR_ASM_TUNER=1`` keeps jittor's path for every kernel. The
kernel cache is keyed on the compile command, so the first run after switching either way
compiles its kernels again. The script also compiles every CPU kernel (either way) with the
headers all of them start with (``pch/jt_kernel.h``: jittor's ``var.h``, ``op_register.h``,
``executor.h``, ``fused_op.h`` and the C++ library, about 75,000 lines parsed before a kernel's
own code) precompiled once into the kernel cache (``lora_pch/``); the same machine code
(tests/test_jit_cc.py), a fraction of the time. ``LORA_JITTOR_PCH=0`` turns that off (not part
of the cache key: a cache is valid either way). Both are on/off switches (:func:`switch`): ``1``,
``on``, ``true``, ``yes`` or ``0``, ``off``, ``false``, ``no``, any case; setting up the backend
refuses another value naming the variable.
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

from lora_core.gpu_check import cuda_driver_present, find_nvcc

# Why jittor was set up for the CPU on a machine with an NVIDIA driver (None: it was not).
no_cuda_reason: str | None = None


def jittor_installed_toolkits() -> list[str]:
    """The ``nvcc`` of each toolkit jittor's installer put in ``~/.cache/jittor/jtcuda``
    (``$JITTOR_HOME`` instead of ``~`` when set)."""
    home = os.environ.get("JITTOR_HOME") or str(Path.home())
    return sorted(glob.glob(os.path.join(home, ".cache", "jittor", "jtcuda", "*", "bin", "nvcc")))


# this backend's on/off variables (read here, and LORA_JITTOR_PCH by jit_cc.sh, which parses it alike)
SWITCHES = {"LORA_JITTOR_ASM_TUNER": False, "LORA_JITTOR_PCH": True}  # name: its default (unset or empty)
_ON, _OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def switch(name: str, default: bool | None = None) -> bool:
    """The on/off variable ``name``: ``1``/``on``/``true``/``yes`` or ``0``/``off``/``false``/``no``
    (any case, blanks around ignored); unset or empty: ``default`` (:data:`SWITCHES`'). Another
    value is refused naming the variable."""
    raw = os.environ.get(name, "")
    v = raw.strip().lower()
    if not v:
        return SWITCHES[name] if default is None else default
    if v in _ON or v in _OFF:
        return v in _ON
    raise ValueError(f"{name}={raw!r}: expected an on/off switch: 1, on, true, yes or 0, off, false, no")


def check_switches() -> None:
    """Refuse a value of one of :data:`SWITCHES` that is not on/off, naming it (before jittor compiles
    anything: ``jit_cc.sh``, which runs inside jittor's compiles, treats it as unset)."""
    for name in SWITCHES:
        switch(name)


def configure() -> None:
    """Set jittor's environment switches; a no-op for anything the user already set. A value of
    this backend's own on/off variables that is not one is refused first (:func:`switch`)."""
    global no_cuda_reason
    check_switches()
    if "nvcc_path" not in os.environ:
        if not cuda_driver_present():
            os.environ["nvcc_path"] = ""
        elif not find_nvcc() and not jittor_installed_toolkits():
            os.environ["nvcc_path"] = ""
            no_cuda_reason = ("no CUDA toolkit was found, so the backend set jittor up for the CPU instead of "
                              "letting its import download one")
    os.environ.setdefault("log_silent", "1")
    os.environ.setdefault("use_parallel_op_compiler", str(COMPILE_THREADS))


# jittor's kernel compiler threads: 1, the calling thread (module docstring: its threads race).
COMPILE_THREADS = 1


def import_jittor() -> None:
    """Import jittor; on a machine with an NVIDIA driver a crash there (jittor compiling its
    CUDA sources against an unsupported toolkit) becomes ``GPUSelfCheckError`` naming it."""
    try:
        import jittor  # noqa: F401
    except Exception as e:
        if os.environ.get("nvcc_path") == "" or not cuda_driver_present():
            raise
        from lora_core.gpu_check import self_check_error

        raise self_check_error("jittor", f"importing jittor failed: {type(e).__name__}: {str(e).strip()[:500]}") from e
    use_direct_compile()


JIT_CC = Path(__file__).with_name("jit_cc.sh")


def use_direct_compile() -> bool:
    """Route jittor's CPU kernel compiles through ``jit_cc.sh`` (module docstring); False, and
    jittor's path unchanged, with ``LORA_JITTOR_ASM_TUNER`` on (:func:`switch`), off Linux, or when the script is
    not executable (e.g. a copy that lost its mode)."""
    import jittor

    if switch("LORA_JITTOR_ASM_TUNER"):
        return False
    if not sys.platform.startswith("linux") or not os.access(JIT_CC, os.X_OK) or " " in str(JIT_CC):  # jittor does not quote it
        return False
    current = jittor.flags.python_path
    if current != str(JIT_CC):
        os.environ["LORA_JITTOR_PYTHON"] = current  # the interpreter jittor chose, for what the script passes on
        jittor.flags.python_path = str(JIT_CC)
    return True
