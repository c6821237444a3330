"""The allocator of ours-torch's Llama runs (``lora_core.train.allocator``): the rule, the
lookup, the relaunch, and the same numbers under tcmalloc as under glibc's malloc."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lora_core.train import allocator, heap


def test_mode_and_rule(monkeypatch):
    monkeypatch.delenv(allocator.ENV, raising=False)
    assert allocator.mode() == "auto"
    for v, want in (("glibc", "glibc"), (" TCMALLOC ", "tcmalloc"), ("", "auto")):
        monkeypatch.setenv(allocator.ENV, v)
        assert allocator.mode() == want
    monkeypatch.setenv(allocator.ENV, "jemalloc")
    with pytest.raises(ValueError, match="LORA_ALLOCATOR='jemalloc': expected one of auto, glibc, tcmalloc"):
        allocator.mode()
    w = allocator.wanted
    assert w("auto", "ours-torch", "llama") and not w("auto", "ours-torch", "gpt2")
    assert w("tcmalloc", "ours-torch", "gpt2") and not w("glibc", "ours-torch", "llama")
    assert not any(w(m, s, "llama") for m in allocator.MODES for s in ("ours-jittor", "hf-peft"))
    with pytest.raises(ValueError, match="allocator mode 'x'"):
        w("x", "ours-torch", "llama")


def test_find_active_and_preload_env(tmp_path):
    assert allocator.find_tcmalloc([tmp_path]) is None
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    assert allocator.find_tcmalloc([tmp_path / "none", tmp_path]) == str(tmp_path / "libtcmalloc.so.4")
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")  # the minimal build first
    assert allocator.find_tcmalloc([tmp_path]) == str(tmp_path / "libtcmalloc_minimal.so.4")
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert allocator.active(str(maps)) == "glibc"
    maps.write_text(maps.read_text() + "7f02-7f03 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4\n")
    assert allocator.active(str(maps)) == "tcmalloc" and allocator.active(str(tmp_path / "gone")) == "glibc"
    env = allocator.preload_env({"LD_PRELOAD": "/x/a.so:/t/tc.so", "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "5"}, "/t/tc.so")
    assert env["LD_PRELOAD"] == "/t/tc.so:/x/a.so" and env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "5"
    assert allocator.preload_env({}, "/t/tc.so") == {"LD_PRELOAD": "/t/tc.so", **allocator.QUIET}


def test_relaunch_only_where_wanted(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "execve", lambda exe, argv, env: calls.append((exe, argv, env)))
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda dirs=None: "/t/libtcmalloc_minimal.so.4")
    monkeypatch.setattr(allocator, "active", lambda maps="": "glibc")
    monkeypatch.delenv(allocator.RELAUNCHED, raising=False)
    monkeypatch.delenv(allocator.ENV, raising=False)
    allocator.relaunch("gpt2", ["py", "-m", "m"])  # auto: Llama runs only
    monkeypatch.setenv(allocator.ENV, "glibc")
    allocator.relaunch("llama", ["py", "-m", "m"])
    assert calls == []
    monkeypatch.setenv(allocator.ENV, "auto")
    allocator.relaunch("llama", ["python3", "-u", "-m", "examples.lm.train", "--x"])
    (exe, argv, env), = calls
    assert exe == sys.executable and argv == [sys.executable, "-u", "-m", "examples.lm.train", "--x"]
    assert env["LD_PRELOAD"].split(":")[0] == "/t/libtcmalloc_minimal.so.4" and env[allocator.RELAUNCHED] == "1"
    monkeypatch.setenv(allocator.RELAUNCHED, "1")  # once only, even if the preload did not take
    allocator.relaunch("llama", ["py", "-m", "m"])
    monkeypatch.delenv(allocator.RELAUNCHED)
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda dirs=None: None)  # not installed: glibc, trimmed
    allocator.relaunch("llama", ["py", "-m", "m"])
    assert len(calls) == 1


TCMALLOC = allocator.find_tcmalloc()
needs_tcmalloc = pytest.mark.skipif(TCMALLOC is None, reason="tcmalloc not installed (apt-get install libtcmalloc-minimal4)")


@needs_tcmalloc
def test_relaunched_process_runs_tcmalloc_and_skips_the_trim():
    code = ("from lora_core.train import allocator, heap; allocator.relaunch('llama'); "
            "print(allocator.active(), heap.available())")  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    for mode, want in (("auto", "tcmalloc False"), ("glibc", f"glibc {heap._libc() is not None}")):
        env.pop(allocator.RELAUNCHED, None)
        out = subprocess.run([sys.executable, "-c", code], env=dict(env, LORA_ALLOCATOR=mode, LORA_MALLOC_TRIM="auto"),
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert out.returncode == 0 and out.stdout.split() == want.split(), out.stderr


def test_malloc_probe_reports_the_heap(capsys):
    from examples.lm import malloc_probe

    assert malloc_probe.main(["--shape", "tiny-llama", "--batch", "1", "--block", "16", "--steps", "1", "--gc"]) == 0
    out = capsys.readouterr().out
    assert "step " in out and f"malloc {allocator.active()}" in out and "glibc heap" in out
