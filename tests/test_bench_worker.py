"""The benchmarks' worker processes: a result comes back, and a failed system's row says why
(the exception's type and message, or the signal that killed it)."""

from __future__ import annotations

import json

from examples import bench_worker
from examples.bench_worker import error_reason, exit_reason, run_as_worker, spawn

FAKE = '''
import os, sys
from examples.bench_worker import run_as_worker

def run(spec):
    if spec["do"] == "raise":
        raise ValueError("precision='bf16' is not supported\\n  by this system")
    if spec["do"] == "abort":
        os.abort()  # what glibc does on "double free or corruption"
    if spec["do"] == "silent":
        sys.exit(0)
    return {"x": spec["x"] * 2}

if __name__ == "__main__":
    sys.exit(run_as_worker(run, sys.argv[2]))
'''


def test_spawned_workers_report_results_exceptions_and_signals(tmp_path, monkeypatch):
    """Also with jittor imported in this process: jittor quits its process on SIGCHLD from a
    child killed by a signal, which ``spawn``'s shell absorbs."""
    from lora_core import get_backend

    get_backend("jittor")
    (tmp_path / "fake_bench_worker.py").write_text(FAKE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    ok = spawn("fake_bench_worker", {"do": "run", "x": 21}, threads=1)
    assert ok["x"] == 42 and ok["wall_s"] > 0 and "error" not in ok
    raised = spawn("fake_bench_worker", {"do": "raise"}, threads=1)
    assert raised["error"] == "worker exited with 1: ValueError: precision='bf16' is not supported by this system"
    assert spawn("fake_bench_worker", {"do": "abort"}, threads=1)["error"] == "worker killed by SIGABRT"
    assert spawn("fake_bench_worker", {"do": "silent"}, threads=1)["error"] == "worker printed no result"


def test_run_as_worker_prints_one_json_line(capsys):
    assert run_as_worker(lambda spec: {"n": spec["n"] + 1}, json.dumps({"n": 1})) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {"n": 2}

    def boom(_):
        raise RuntimeError("x" * 1000)

    assert run_as_worker(boom, "{}") == 1
    captured = capsys.readouterr()
    said = json.loads(captured.out.splitlines()[-1])["error"]
    assert said.startswith("RuntimeError: xxx") and len(said) == bench_worker.MAX_REASON and said.endswith("...")
    assert "Traceback" in captured.err  # the whole story stays on stderr


def test_reasons():
    assert error_reason(KeyError("a")) == "KeyError: 'a'"
    assert exit_reason(2) == "exited with 2"
    assert exit_reason(-9) == "killed by SIGKILL"
    assert exit_reason(-200) == "killed by signal 200"
    assert exit_reason(128 + 6) == "killed by SIGABRT"  # as sh reports it
    assert exit_reason(128) == "exited with 128"
