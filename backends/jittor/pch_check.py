"""Compile jittor's kernels again, with and without ``jit_cc.sh``'s precompiled headers, and
compare their machine code (the check behind docs/testing.md's "Precompiled headers" figures)::

    python -m backends.jittor.pch_check --out /tmp/pch [--cache DIR] [--limit N]

Each kernel of the cache's ``jit/`` folder (default: the cache of ``$JITTOR_HOME``, filled by the
runs that compiled it) is compiled by the command jittor recorded for it (the first line of its
``.so.key``), through this checkout's ``jit_cc.sh``, once with ``LORA_JITTOR_PCH=0`` and once with
``1``, from a copy of its source into ``OUT/jit/{0,1}/`` (the headers build under
``OUT/jit/lora_pch``); prints how many have the same ``.text`` both ways and the compilers' CPU
seconds each way. Needs binutils' ``objcopy`` (g++ needs binutils). Never imports torch.
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import subprocess
import sys
from pathlib import Path

JIT_CC = Path(__file__).with_name("jit_cc.sh")


def recorded_command(key: Path) -> list[str]:
    """The compile command jittor recorded for a kernel (its ``.so.key``'s first line)."""
    return shlex.split(key.read_text().splitlines()[0])


def text_section(so: Path) -> bytes:
    """A library's machine code (its ``.text`` section)."""
    out = so.with_name(so.name + ".text")
    subprocess.run(["objcopy", "-O", "binary", "--only-section=.text", str(so), str(out)], check=True)
    return out.read_bytes()


def compile_both_ways(key: Path, out: Path, extra_flags: tuple[str, ...] = ()) -> tuple[list[bytes], list[float]]:
    """The kernel of ``key`` compiled by its recorded command through ``JIT_CC`` (plus
    ``extra_flags``) without and with the precompiled headers, from a copy of its source in
    ``out/jit/{0,1}``: each library's ``.text`` and the compile's CPU seconds. A failed compile
    (or a header g++ reports it did not use) raises RuntimeError with the compiler's output."""
    args = recorded_command(key)
    src, i = Path(args[3]), args.index("-o")
    name = Path(args[i + 1]).name
    env = dict(os.environ)
    env.setdefault("LORA_JITTOR_PYTHON", sys.executable)  # jittor's assembly tuner, for kernels it rewrites
    texts, cpu = [], []
    for on in ("0", "1"):
        d = out / "jit" / on
        d.mkdir(parents=True, exist_ok=True)
        (d / src.name).write_text(src.read_text())
        so = d / name
        cmd = [str(JIT_CC), *args[1:3], str(d / src.name), *args[4:i], *extra_flags, "-o", str(so), *args[i + 2 :]]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        r = subprocess.run(cmd, env={**env, "LORA_JITTOR_PCH": on}, capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if r.returncode or "not used" in r.stderr:
            raise RuntimeError(f"{key.name} (LORA_JITTOR_PCH={on}): {r.stderr[-2000:]}")
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        texts.append(text_section(so))
    return texts, cpu


def default_cache() -> Path:
    """The kernel folder of jittor's cache (``jittor.flags.cache_path``), through the backend."""
    import lora_core as lc

    lc.get_backend("jittor")
    import jittor

    return Path(jittor.flags.cache_path) / "jit"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backends.jittor.pch_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="a folder for the compiled copies")
    ap.add_argument("--cache", type=Path, help="a kernel cache's jit/ folder (default: $JITTOR_HOME's)")
    ap.add_argument("--limit", type=int, help="the first N kernels (by name) only")
    args = ap.parse_args(argv)
    jit = args.cache or default_cache()
    keys = sorted(jit.glob("*_op.so.key"))[: args.limit]
    if not keys:
        print(f"error: --cache {jit}: no kernel (*_op.so.key)", file=sys.stderr)
        return 2
    same, differ, cpu = 0, [], [0.0, 0.0]
    for n, key in enumerate(keys, 1):
        texts, seconds = compile_both_ways(key, args.out)
        same += texts[0] == texts[1]
        if texts[0] != texts[1]:
            differ.append(key.name)
        cpu = [c + s for c, s in zip(cpu, seconds)]
        print(f"\r{n}/{len(keys)} kernels", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    tuner = sum("@begin" in Path(recorded_command(k)[3]).read_text() for k in keys)
    print(f"kernels {len(keys)} ({tuner} through jittor's assembly tuner): .text the same {same}, different {len(differ)}")
    print(f"compilers' CPU seconds: {cpu[0]:.1f} without the precompiled headers, {cpu[1]:.1f} with (their builds included)")
    for name in differ:
        print(f"different: {name}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
