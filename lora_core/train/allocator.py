"""Which ``malloc`` an ours-torch training process of a Llama-family model runs with: glibc's,
or tcmalloc (gperftools' thread-caching malloc, the allocator PyTorch's own CPU launcher,
``python -m torch.backends.xeon.run_cpu``, preloads by default).

PyTorch allocates CPU tensors with ``malloc``. glibc serves the 8-23 MB activations of a Llama
layer from its heap, and what a step frees there stays resident, scattered between live blocks:
measured on llama-bench (8 layers, hidden 1024, batch 4 x 512, LoRA + activation checkpointing,
glibc 2.36, untrimmed) the heap held 844-1006 MB while at most 380 MB of it was in use
(``mallinfo2`` sampled every millisecond). Returning those pages with ``malloc_trim`` at the layers
(``lora_core.train.heap``) brings the peak down, at the cost of a page fault for each page a later
layer touches again. tcmalloc keeps freed spans by size and hands them to the next allocation of
that size, so a step's peak stays near its live tensors with no trim and no page faults. The same
bench, one process per row (``python -m examples.lm.bench --batch 4 --block 512 --methods
lora,lora-gc --systems ours-torch``, AMD EPYC, one thread, 0f29f96): LoRA 189.4 vs 188.9 tok/s,
peak private memory 1931 vs 1499 MB; LoRA + GC (glibc trimmed at the layers) 126.4 vs 144.8 tok/s,
1116 vs 978 MB (docs/llama.md).

``LORA_ALLOCATOR`` picks: ``auto`` (or unset) runs tcmalloc where it is installed for a torch
Llama training command (:func:`wanted`), ``tcmalloc`` wants it for every torch command that asks
(where it is not installed the command warns on stderr and runs under glibc's malloc),
``glibc`` never. A Python process cannot change its ``malloc`` once started: a command that wants
tcmalloc and does not run under it re-executes itself with it in ``LD_PRELOAD`` (:func:`relaunch`),
before torch is imported; the benches start their workers with it (:func:`preload_env`). A process
that runs glibc's malloc (tcmalloc not installed, ``LORA_ALLOCATOR=glibc``, or a library user's own
script) trims the heap as before. Numbers do not depend on it: the same loss, bit for bit
(tests/test_allocator.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

MODES = ("auto", "glibc", "tcmalloc")
ENV = "LORA_ALLOCATOR"
# set in a relaunched process: the relaunch happened once (a preload that failed is not retried)
RELAUNCHED = "LORA_ALLOCATOR_RELAUNCHED"
# tcmalloc's shared objects, the minimal build first (no heap profiler: Debian's libtcmalloc-minimal4)
NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")
# tcmalloc reports every allocation above 1 GB on stderr by default (a Llama-3 embedding is one)
QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}


def mode() -> str:
    """``LORA_ALLOCATOR``'s mode (unset: ``auto``); another value is refused naming the variable."""
    v = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if v not in MODES:
        raise ValueError(f"{ENV}={v!r}: expected one of {', '.join(MODES)}")
    return v


def wanted(mode_: str, system: str, kind: str) -> bool:
    """The rule: tcmalloc for an ours-torch run of a Llama-family model under ``auto``, for every
    ours-torch run under ``tcmalloc``, never under ``glibc`` nor for another system (Jittor has
    its own allocator; transformers + peft is run as its users run it)."""
    if mode_ not in MODES:
        raise ValueError(f"allocator mode {mode_!r}: expected one of {MODES}")
    return system == "ours-torch" and (mode_ == "tcmalloc" or (mode_ == "auto" and kind == "llama"))


def search_dirs() -> list[Path]:
    """Where :func:`find_tcmalloc` looks: this Python's prefixes' ``lib``, then the system's
    library folders (Debian's multiarch one included)."""
    dirs = [Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib"]
    if os.environ.get("CONDA_PREFIX"):
        dirs.append(Path(os.environ["CONDA_PREFIX"]) / "lib")
    arch = os.uname().machine
    dirs += [Path(p) for p in (f"/usr/lib/{arch}-linux-gnu", f"/lib/{arch}-linux-gnu", "/usr/local/lib", "/usr/lib64", "/usr/lib")]
    return dirs


def find_tcmalloc(dirs: list[Path] | None = None) -> str | None:
    """The path of an installed tcmalloc (:data:`NAMES` in :func:`search_dirs`), or None."""
    for d in search_dirs() if dirs is None else dirs:
        for name in NAMES:
            if (d / name).is_file():
                return str(d / name)
    return None


_ACTIVE: list = []  # this process's malloc, read once: it cannot change while the process runs


def active(maps: str | None = None) -> str:
    """``tcmalloc`` if a tcmalloc library is mapped into this process (it then serves ``malloc``:
    it can only have come in through ``LD_PRELOAD`` or a link), else ``glibc``; ``maps``: a
    ``/proc/PID/maps`` file to read instead of this process's (read once)."""
    if maps is None and _ACTIVE:
        return _ACTIVE[0]
    try:
        text = Path(maps or "/proc/self/maps").read_text()
    except OSError:
        text = ""
    found = "tcmalloc" if "libtcmalloc" in text else "glibc"
    if maps is None:
        _ACTIVE.append(found)
    return found


def preload_env(env: dict, lib: str) -> dict:
    """``env`` with ``lib`` first in ``LD_PRELOAD`` (kept once) and tcmalloc's large-allocation
    reports off (:data:`QUIET`, unless set)."""
    rest = [p for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p and p != lib]
    out = dict(env, LD_PRELOAD=":".join([lib, *rest]))
    for k, v in QUIET.items():
        out.setdefault(k, v)
    return out


def worker_env(env: dict, system: str, kind: str) -> dict:
    """The environment to start a bench worker of ``system`` training a ``kind`` model with:
    tcmalloc preloaded where :func:`wanted` says and it is installed, else ``env`` unchanged."""
    lib = find_tcmalloc() if wanted(mode(), system, kind) else None
    return preload_env(env, lib) if lib else env


INSTALL = "apt-get install libtcmalloc-minimal4"  # Debian/Ubuntu's package (scripts/lora.sh installs it)


def missing_warning() -> str:
    """What a command says on stderr when ``LORA_ALLOCATOR=tcmalloc`` asks for tcmalloc and
    :func:`find_tcmalloc` finds none: the run goes on under glibc's malloc (the same numbers;
    only the memory and time figures differ)."""
    return (f"warning: {ENV}=tcmalloc, but tcmalloc was not found ({NAMES[0]} or {NAMES[1]}): running with glibc's "
            f"malloc (the same results; memory and speed figures differ). Install it ({INSTALL}; gperftools' "
            f"tcmalloc elsewhere) or set {ENV}=glibc")


def relaunch(kind: str, argv: list[str] | None = None) -> None:
    """Re-execute this command under tcmalloc where :func:`wanted` says (an ours-torch ``kind``
    run), it is installed, this process does not run it yet and has not been relaunched already;
    otherwise return (the run keeps glibc's malloc and trims the heap). ``argv``: the command
    line to run again (default ``sys.orig_argv``: the interpreter, its options, ``-m module``,
    the arguments). Call it before importing torch: nothing done before it survives. Where
    ``LORA_ALLOCATOR=tcmalloc`` asks for it and it is not installed, it warns on stderr
    (:func:`missing_warning`) and returns: the run goes on under glibc's malloc."""
    if not wanted(mode(), "ours-torch", kind) or os.environ.get(RELAUNCHED) or active() == "tcmalloc":
        return
    lib = find_tcmalloc()
    if lib is None:
        if mode() == "tcmalloc":  # asked for by name: say why it does not run (auto says nothing)
            print(missing_warning(), file=sys.stderr, flush=True)
        return
    env = dict(preload_env(os.environ, lib), **{RELAUNCHED: "1"})
    argv = list(sys.orig_argv if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], env)
