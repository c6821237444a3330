"""The causal-LM benchmark (``examples.lm.bench``) runs end to end on a tiny Llama shape, in
its own process as a user runs it: rows for both systems, positive throughput and memory, and
greedy tokens equal to transformers + peft's (a smoke test, not a timed test)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_lm_bench_tiny(tmp_path):
    out = tmp_path / "lm_bench.json"
    cmd = [sys.executable, "-m", "examples.lm.bench", "--shape", "tiny-llama", "--steps", "1", "--new-tokens", "4",
           "--block", "16", "--systems", "ours-torch,hf-peft", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    table = proc.stdout
    assert "ours-torch / hf-peft" in table and "fp32 GEMM peak" in table, table
    result = json.loads(out.read_text())
    assert set(result["raw"]) == {"ours-torch", "hf-peft"}
    for system, (run,) in result["raw"].items():
        assert run["train_tok_s"] > 0 and run["decode_s"] > 0, (system, run)
        assert run["train_peak_rss_mb"] > 0 and run["train_peak_private_mb"] > 0, (system, run)
        assert len(run["step_s"]) == 2 and [len(t) for t in run["tokens"]] == [4, 4], (system, run)
    ours, hf = result["raw"]["ours-torch"][0], result["raw"]["hf-peft"][0]
    assert ours["tokens"] == hf["tokens"]
    assert abs(ours["loss"][0] - hf["loss"][0]) < 1e-4  # same weights, same batch, B = 0
    assert result["summary"]["same_tokens"] == {"ours-torch": True, "hf-peft": True}
    assert result["gemm"]["peak_gflops"] > 0 and result["flops_per_token"]["train_step"] > 0


def test_lm_bench_methods_tiny(tmp_path):
    """``--methods``: full fine-tuning and QLoRA with activation checkpointing run in ours-torch,
    with the memory split and a PNG of the table."""
    out, png = tmp_path / "methods.json", tmp_path / "methods.png"
    cmd = [sys.executable, "-m", "examples.lm.bench", "--shape", "tiny-llama", "--steps", "1", "--block", "16",
           "--systems", "ours-torch", "--methods", "full,qlora-gc", "--json", str(out), "--plot", str(png)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "methods:" in proc.stdout and "qlora-gc" in proc.stdout, proc.stdout
    rows = json.loads(out.read_text())["summary"]["methods"]
    assert [(r["method"], r["system"]) for r in rows] == [("full", "ours-torch"), ("qlora-gc", "ours-torch")]
    full, qlora = rows
    assert full["tok_s"] > 0 and qlora["tok_s"] > 0 and full["vs_full"] == 1.0
    # full fine-tuning: a gradient and two AdamW moments per weight; QLoRA: 4-bit weights, LoRA-sized rest
    assert full["parts_mb"]["gradients"] > 0 and full["parts_mb"]["optimizer"] == 2 * full["parts_mb"]["gradients"]
    assert qlora["parts_mb"]["weights"] < 0.6 * full["parts_mb"]["weights"]  # tiny: embeddings stay fp32
    assert qlora["parts_mb"]["gradients"] < full["parts_mb"]["gradients"] / 5  # r 8 is large at width 32
    assert png.stat().st_size > 10_000
