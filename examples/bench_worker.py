"""The benchmarks' workers (``examples.nlg.bench``, ``examples.cls.bench``): each system runs in
a fresh interpreter, so its peak RSS and its threads are its own, and a crash costs one row.

``spawn(module, spec)`` runs ``python -m MODULE --worker SPEC_JSON`` and returns the dict the
worker printed as its last stdout line. The worker side, ``run_as_worker(run, spec_json)``,
prints ``run(spec)``'s result, or ``{"error": "Type: message"}`` when ``run`` raises, so that a
failed system's row says why (a refused precision, jittor's GPU self-check) and not only how
the process ended; a worker killed by a signal is reported by the signal's name.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_REASON = 300  # characters of an error message in a table's errors column


def error_reason(e: BaseException) -> str:
    """``Type: message`` on one line (whitespace collapsed, at most ``MAX_REASON`` characters)."""
    text = re.sub(r"\s+", " ", f"{type(e).__name__}: {e}").strip()
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


def run_as_worker(run, spec_json: str) -> int:
    """Run ``run(spec)``; print its result (a JSON-able dict) as one line and return 0, or on
    an exception print the traceback to stderr, ``{"error": reason}`` to stdout and return 1."""
    try:
        out = run(json.loads(spec_json))
    except Exception as e:  # any failure of the system under test: its row reports it
        traceback.print_exc()
        print(json.dumps({"error": error_reason(e)}), flush=True)
        return 1
    print(json.dumps(out), flush=True)
    return 0


def exit_reason(returncode: int) -> str:
    """``exited with 1``; ``killed by SIGABRT`` for a signal, given as a negative return code
    or as the shell's 128 + N (``spawn`` runs the worker under ``sh``)."""
    number = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    if not number:
        return f"exited with {returncode}"
    try:
        return f"killed by {signal.Signals(number).name}"
    except ValueError:
        return f"killed by signal {number}"


def launcher(engine: str, nproc: int) -> list[str]:
    """The command prefix that starts ``nproc`` copies of a Python program for a job of
    ``engine``'s processes: ``torchrun --standalone`` (``"torch"``: torch.distributed, gloo on
    CPU) or ``mpirun`` (``"mpi"``: jittor; ``--allow-run-as-root`` as root, oversubscribed, the
    thread setting exported); the interpreter alone for one process. ``-m MODULE ARGS`` follows."""
    if nproc == 1:
        return [sys.executable]
    if engine == "torch":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    if engine != "mpi":
        raise ValueError(f"launcher: engine must be 'torch' or 'mpi', got {engine!r}")
    import shutil

    mpirun = shutil.which("mpirun")
    if not mpirun:
        raise RuntimeError("mpirun not found: several jittor processes need Open MPI "
                           "(apt-get install openmpi-bin libopenmpi-dev)")  # fmt: skip
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [mpirun, *root, "--oversubscribe", "--mca", "mpi_yield_when_idle", "1", "-x", "OMP_NUM_THREADS",
            "-x", "MKL_NUM_THREADS", "-x", "PYTHONPATH", "-np", str(nproc), sys.executable]  # fmt: skip


def spawn(module: str, spec: dict, threads: int, launch: list[str] | None = None, env: dict | None = None) -> dict:
    """``python -m module --worker SPEC`` with ``threads`` OpenMP/MKL threads and this
    repository on ``PYTHONPATH``; its result dict with ``wall_s`` added, or ``{"error": ...,
    "wall_s": ...}`` naming the exit and, when the worker said it, the reason. ``launch``: a
    :func:`launcher` prefix that runs several processes (the result: the last line printed);
    ``env``: the environment to start from (default ``os.environ``)."""
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    t0 = time.perf_counter()
    # under sh, which outlives a worker killed by a signal and exits with 128 + N: a process
    # that has imported jittor (a test, a notebook) would otherwise quit on that SIGCHLD
    prog = [*(launch or launcher("torch", 1)), "-m", module]
    cmd = ["sh", "-c", '"$@"; exit $?', "sh", *prog, "--worker", json.dumps(spec)]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    lines = proc.stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        out = None
    if not isinstance(out, dict):
        out = None
    wall = time.perf_counter() - t0
    if proc.returncode == 0 and out is not None and "error" not in out:
        return dict(out, wall_s=wall)
    why = exit_reason(proc.returncode) if proc.returncode else "printed no result"
    said = out.get("error") if out is not None else None
    return {"error": f"worker {why}: {said}" if said else f"worker {why}", "wall_s": wall}


__all__ = ["error_reason", "exit_reason", "launcher", "run_as_worker", "spawn"]


# --------------------------------------------------------------------------- environment

PACKAGES = ("torch", "jittor", "transformers", "peft", "bitsandbytes")


def environment() -> dict:
    """What a benchmark ran with: the versions of ``PACKAGES`` (None: not installed), the CPU
    model and count, and the load average now (call it before the runs)."""
    from importlib import metadata

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), "unknown")
    return {"versions": versions, "cpu": cpu, "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}


def environment_line(env: dict) -> str:
    """One line of ``environment()`` for a benchmark's printed table."""
    v = env["versions"]
    return (f"CPU {env['cpu']} ({env['cpus']} CPUs), load average at start {env['loadavg_start'][0]:.2f}; "
            + ", ".join(f"{k} {v[k] or '-'}" for k in PACKAGES))



# --------------------------------------------------------------------------- options and outputs


def check_compile_backend(name: str | None) -> str | None:
    """Why ``--compile NAME`` cannot run (not one of ``torch._dynamo``'s backends), or None."""
    if name in (None, "off"):
        return None
    from torch._dynamo import list_backends

    known = list_backends(exclude_tags=())
    return None if name in known else f"--compile: unknown dynamo backend {name!r}; choose from {', '.join(known)}"


def check_outputs(**paths: Path | None) -> str | None:
    """Why an output file (``--json``, ``--plot``: keyword = option without the dashes) cannot be
    written where asked (a folder, or a parent folder that does not exist), checked before the runs
    (a bench of hours loses nothing at its end), or None."""
    for opt, path in paths.items():
        if path is None:
            continue
        flag = "--" + opt.replace("_", "-")
        if path.is_dir():
            return f"{flag} {path}: is a folder (give a file name)"
        if not path.parent.is_dir():
            return f"{flag} {path}: the folder {path.parent} does not exist"
    return None


def write_output(path: Path, text: str) -> None:
    """Write a bench output atomically (a temp file beside it, then renamed): an interrupted
    write leaves the previous file whole."""
    from lora_core.data.nlg import write_text_atomic

    write_text_atomic(path, text)
