"""The embedded demo gives the same figures whatever thread count the caller's environment
asks for (it pins its own), and its report separates first-use time from steady state."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--backends", "torch", "--pretrain-steps", "40", "--steps", "12", "--test-limit", "3"]


def _run(out: Path, threads_env: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if threads_env is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = threads_env
    proc = subprocess.run([sys.executable, "-m", "examples.nlg.demo", "--out", str(out), *SMALL], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "parity.json").read_text())


def test_demo_figures_do_not_depend_on_the_callers_threads(tmp_path):
    a = _run(tmp_path / "a", None)
    b = _run(tmp_path / "b", "2")
    assert a["scores"] == b["scores"]
    from safetensors.numpy import load_file

    base_a, base_b = (load_file(tmp_path / x / "base" / "model.safetensors") for x in ("a", "b"))
    assert base_a.keys() == base_b.keys() and all((base_a[k] == base_b[k]).all() for k in base_a)
    for name in ("torch/beam.jsonl", "torch/pred.txt"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    la = [json.loads(x)["loss"] for x in (tmp_path / "a/torch/log.jsonl").read_text().splitlines() if '"train"' in x]
    lb = [json.loads(x)["loss"] for x in (tmp_path / "b/torch/log.jsonl").read_text().splitlines() if '"train"' in x]
    assert la == lb and len(la) == 12
    report = (tmp_path / "a" / "parity.md").read_text()
    for row in ("steady state", "first update", "warm-up"):
        assert row in report, report
    assert a["train_step_ms"]["torch"] > 0 and a["beam_s"]["torch"] > 0 and a["beam_warmup_s"]["torch"] > 0
