"""The causal-LM benchmark (``examples.lm.bench``) runs end to end on a tiny Llama shape, in
its own process as a user runs it: rows for both systems, positive throughput and memory, and
greedy tokens equal to transformers + peft's (a smoke test, not a timed test)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_close

ROOT = Path(__file__).resolve().parents[1]


def test_lm_bench_tiny(tmp_path):
    out = tmp_path / "lm_bench.json"
    cmd = [sys.executable, "-m", "examples.lm.bench", "--shape", "tiny-llama", "--steps", "1", "--new-tokens", "4",
           "--block", "16", "--systems", "ours-torch,hf-peft", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
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
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
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


def test_lm_bench_gpt2_methods_tiny(tmp_path):
    """``--shape tiny`` (GPT-2): the bench writes a transformers GPT-2 checkpoint that ours and
    transformers + peft + bitsandbytes both load, full and 4-bit; QLoRA's LoRA on ``attn.c_attn``
    (whole, 3E wide) and ``attn.c_proj`` in both (the worker checks peft's names against ours').
    Same weights, same 4-bit codes: the first losses agree; after one update, which the LoRA A
    values and targets decide, the second ones too. (``lora`` and its greedy decoding are left
    out to keep the test short: 4 worker processes.)"""
    out = tmp_path / "gpt2.json"
    cmd = [sys.executable, "-m", "examples.lm.bench", "--shape", "tiny", "--steps", "1", "--block", "16",
           "--systems", "ours-torch,hf-peft", "--methods", "full,qlora", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "GPT-2: hidden 64" in proc.stdout and "on attn.c_attn,attn.c_proj" in proc.stdout, proc.stdout
    assert "methods:" in proc.stdout and "qlora" in proc.stdout, proc.stdout
    result = json.loads(out.read_text())
    rows = result["summary"]["methods"]
    expected = [(m, s) for m in ("full", "qlora") for s in ("hf-peft", "ours-torch")]
    assert [(r["method"], r["system"]) for r in rows] == expected
    assert all(r["tok_s"] > 0 and r["private_mb"] > 0 for r in rows), rows
    # the planner's column and the 4-bit formula cover GPT-2 (lora_core.plan.bench_plan)
    assert all(r["predicted_mb"] > 0 for r in rows), rows
    assert "qlora weights ours-torch:" in proc.stdout and "formula" in proc.stdout, proc.stdout
    raw = result["raw"]
    for method in ("full", "qlora"):
        ours, hf = raw[f"ours-torch {method}"][0]["loss"], raw[f"hf-peft {method}"][0]["loss"]
        assert abs(ours[0] - hf[0]) <= 1e-5 * hf[0], (method, ours, hf)
        # full FT's second loss differs by ~2e-5: ours' AdamW adds eps before the bias correction
        # (the paper code's), torch.optim.AdamW after it, so weights with small gradients move apart
        assert abs(ours[1] - hf[1]) <= (1e-5 if method == "qlora" else 1e-4) * hf[1], (method, ours, hf)
    # LoRA on c_attn (64 -> 192) and attn.c_proj (64 -> 64) of 2 blocks: 2 r (in + out) FLOPs each
    assert result["flops_per_token"]["lora"] == 2 * 2 * 8 * ((64 + 192) + (64 + 64))


def test_same_tokens_compares_systems_not_one_with_itself():
    """The ``same`` column compares each system's greedy tokens with hf-peft's (or the first
    decoding system's); with one system decoding there is nothing to compare: ``-``, not ``yes``."""
    from examples.lm.bench import same_tokens

    a, b = {"tokens": [[1, 2]]}, {"tokens": [[1, 3]]}
    assert same_tokens({"ours-torch": [a, a]}) == {"ours-torch": None}
    assert same_tokens({"ours-torch": [a], "ours-jittor": [{}]}) == {"ours-torch": None, "ours-jittor": None}
    assert same_tokens({"ours-torch": [a], "hf-peft": [b]}) == {"ours-torch": False, "hf-peft": True}
    assert same_tokens({"ours-torch": [a, b], "ours-jittor": [a]}) == {"ours-torch": False, "ours-jittor": True}
    assert same_tokens({"ours-torch": [a], "ours-jittor": [a], "hf-peft": [{}]})["hf-peft"] is None


def test_gpt2_flops_per_token():
    """The bench's FLOP count on GPT-2 (``lora_core.models.gpt2.count_flops_per_token`` + LoRA on
    c_attn and attn.c_proj) equals the memory planner's, written apart, for full FT and LoRA."""
    from examples.lm.bench import train_flops_per_token
    from examples.lm.methods_table import method_flops
    from lora_core.models.gpt2 import PRESETS
    from lora_core.plan.memory import PlanConfig, plan

    cfg = PRESETS["gpt2"]
    f = train_flops_per_token(cfg, 512)
    assert f["matmul"] == 2 * (12 * 12 * 768**2 + 50257 * 768)  # the blocks' projections and the tied head
    for method, targets in (("full", ()), ("lora", ("c_attn", "attn.c_proj"))):
        planned = plan(cfg, PlanConfig(method=method, targets=targets or ("c_attn",), seq=512)).flops_per_token
        assert planned == pytest.approx(method_flops(f, method), rel=1e-12), method


def test_decoding_floor_reads_the_head_once_and_no_lookup_table():
    """A decoding step reads every projection and the LM head once; the token (and GPT-2's
    position) embeddings are lookups of a few rows, not streamed: the floor's bytes."""
    from examples.lm.bench_shapes import weight_bytes
    from lora_core.models import gpt2, llama
    from lora_core.models.gpt2 import PRESETS

    for name in ("llama-bench", "llama-3.2-1b"):  # untied, tied
        cfg = llama.llama_config(name)
        layers = sum(int(np.prod(s)) for k, s in llama.base_shapes(cfg).items() if k.startswith("model.layers."))
        head = cfg.vocab_size * cfg.hidden_size
        assert weight_bytes(cfg) == 4 * (layers + cfg.hidden_size + head), name  # + the final norm
    g = PRESETS["gpt2"]
    blocks = sum(int(np.prod(s)) for k, s in gpt2.base_shapes(g).items() if k.startswith("h."))
    assert weight_bytes(g) == 4 * (blocks + 2 * g.n_embd + g.vocab_size * g.n_embd)  # ln_f, the tied head


def test_validation_reads_a_bench_file_with_a_failed_repeat(tmp_path):
    """A repeat that failed records no allocator (nor a peak): the others' rows are read."""
    from lora_core.plan.validate import bench_rows

    src = ROOT / "docs" / "bench" / "lm_methods_llama-bench-torch-tcmalloc_98c5579.json"
    d = json.loads(src.read_text())
    key = next(k for k in d["raw"] if k.startswith("ours-torch"))
    d["raw"][key].append({"train_error": "worker exited with 1", "train_wall_s": 1.0})
    (tmp_path / src.name).write_text(json.dumps(d))
    assert [r["measured"] for r in bench_rows([tmp_path / src.name])] == [r["measured"] for r in bench_rows([src])]


def _bench(tmp_path, name: str, *args: str, timeout: int = 900) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "examples.lm.bench", "--shape", "tiny-llama", "--steps", "1", "--block", "16",
           "--new-tokens", "2", "--json", str(out), *args]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return proc, (json.loads(out.read_text()) if out.exists() else {})


def test_lm_bench_zero_rows_match_one_process(tmp_path):
    """ZeRO rows (``-z2``, ``-z3``) and a data-parallel row (``-dp``: transformers + peft in DDP):
    2 processes of 1 row each (torchrun: ours-torch on FSDP2 and
    transformers + peft on FSDP2; mpirun: ours-jittor's sharded AdamW) train on the rows that one
    process gets at ``--batch 2``, so their loss curves (before and after an update) equal the
    one-process rows' within 1e-6; tokens/s counts both ranks' rows, memory is per rank, the
    planner predicts each row. Jittor's ZeRO-3 row is refused by name and the table says why.
    (Each system's sharded rows run once: ours on both stages, transformers + peft on ZeRO-3;
    ``tests/test_zero.py`` checks the engines themselves.)"""
    proc, zero = _bench(tmp_path, "zero", "--batch", "1", "--systems", "ours-torch,ours-jittor", "--methods", "lora-z2-gc,full-z3")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]  # jittor's full-z3 row failed, as it must
    assert "errors: full-z3 ours-jittor: worker exited with 1: ValueError: --zero 3" in proc.stdout, proc.stdout
    assert "ZeRO rows: 2 processes of 1 row(s) each" in proc.stdout, proc.stdout
    proc_hf, zero_hf = _bench(tmp_path, "zero-hf", "--batch", "1", "--systems", "hf-peft", "--methods", "full-z3,full-dp")
    assert proc_hf.returncode == 0, proc_hf.stdout + proc_hf.stderr[-3000:]
    one = {}
    for name, systems, method in (("one-lora", "ours-torch,ours-jittor", "lora-gc"), ("one-full", "ours-torch,hf-peft", "full")):
        proc1, ref = _bench(tmp_path, name, "--batch", "2", "--systems", systems, "--methods", method)
        assert proc1.returncode == 0, proc1.stdout + proc1.stderr[-3000:]
        one.update(ref["raw"])
    raw = {**zero["raw"], **zero_hf["raw"]}
    pairs = [(f"{s} lora-z2-gc", f"{s} lora-gc") for s in ("ours-torch", "ours-jittor")]
    pairs += [(f"{s} full-z3", f"{s} full") for s in ("ours-torch", "hf-peft")] + [("hf-peft full-dp", "hf-peft full")]
    for key, ref in pairs:
        (run,), (run1,) = raw[key], one[ref]
        assert run.get("ranks") == 2 and len(run["per_rank"]) == 2, (key, run.get("error"), proc.stdout[-3000:])
        assert len(run["loss"]) == len(run1["loss"]) == 2, (key, run["loss"])
        assert_close(f"bench ZeRO row vs one process, loss curve ({key})", run["loss"], run1["loss"], 1e-6)
        assert run["train_tok_s"] > 0 and all(r["train_peak_anon_mb"] > 0 for r in run["per_rank"]), key
    rows = {(r["method"], r["system"]): r for r in zero["summary"]["methods"] + zero_hf["summary"]["methods"]}
    assert set(rows) == {("lora-z2-gc", "ours-torch"), ("lora-z2-gc", "ours-jittor"), ("full-z3", "ours-torch"),
                         ("full-z3", "ours-jittor"), ("full-z3", "hf-peft"), ("full-dp", "hf-peft")}, rows  # fmt: skip
    assert rows[("full-z3", "ours-jittor")]["tok_s"] is None
    assert all(r["predicted_mb"] > 0 for k, r in rows.items() if k != ("full-z3", "ours-jittor")), rows


def test_bnb_dequantize_probe():
    """The probe matches what bitsandbytes does on this CPU: widths that are multiples of the
    block (or odd: its generic path) are right everywhere; it is False only for bitsandbytes'
    AVX512 kernel at an even width that is not a multiple of the block."""
    import torch
    from bitsandbytes.backends.cpu import ops as cpu_ops

    from examples.lm.bench_systems import bnb_dequantize_exact

    torch.set_num_threads(1)
    assert bnb_dequantize_exact(64) and bnb_dequantize_exact(128) and bnb_dequantize_exact(31)
    assert bnb_dequantize_exact(32) or getattr(cpu_ops, "_has_avx512", False)


def test_gpu_bench_rows_on_the_cpu(tmp_path):
    """``examples.lm.gpu_bench`` (run on a GPU with ``--device cuda``) on the CPU: every row of
    both systems trains from the same weights (first losses equal), ours' and transformers'
    float32 logits agree, the planner's column is filled, ``--profile`` writes an op table per row;
    a bad method is refused by name."""
    from examples.lm import gpu_bench

    out = tmp_path / "gpu.json"
    rc = gpu_bench.main(["--shape", "tiny-llama", "--batch", "2", "--block", "16", "--steps", "1", "--device", "cpu",
                         "--precision", "fp32", "--methods", "full,lora-gc,qlora", "--check-logits", "--json", str(out),
                         "--profile", str(tmp_path / "prof")])  # fmt: skip
    result = json.loads(out.read_text())
    assert rc == 0, result["table"]
    assert result["settings"]["profile"] == str(tmp_path / "prof")  # one op table per row
    assert "aten::mm" in (tmp_path / "prof" / "ours-torch_lora-gc.txt").read_text()
    assert len(list((tmp_path / "prof").glob("*.txt"))) == 6
    logits = result["logits"]  # LoRA, and QLoRA: ours' NF4 base against bitsandbytes' Linear4bit
    # bitsandbytes' own CPU dequantization is wrong at tiny-llama's widths on AVX512 CPUs
    # (bench_systems.bnb_dequantize_exact): there the QLoRA comparisons have no reference
    exact = logits["bnb_dequantize_exact"]
    assert logits["logits_rel_err"] < 1e-5 and (logits["qlora_logits_rel_err"] < 1e-5 or not exact), logits
    rows = {(r["system"], r["method"]): r for r in result["rows"]}
    assert set(rows) == {(s, m) for s in ("ours-torch", "hf-peft") for m in ("full", "lora-gc", "qlora")}
    for (system, method), r in rows.items():
        assert r["train_tok_s"] > 0 and len(r["loss"]) == 2 and r["plan_mb"] > r["plan_alloc_mb"] > 0, (system, method, r)
        assert r["parts_mb"]["weights"] > 0
    for method in ("full", "lora-gc", "qlora") if exact else ("full", "lora-gc"):
        ours, hf = rows[("ours-torch", method)]["loss"][0], rows[("hf-peft", method)]["loss"][0]
        assert abs(ours - hf) <= 1e-5 * abs(hf), (method, ours, hf)
    assert "ours-torch / hf-peft qlora: tok/s" in result["table"]
    with pytest.raises(SystemExit):
        gpu_bench.main(["--methods", "lora-z2", "--device", "cpu"])


@pytest.mark.gpu
def test_cuda_gpu_bench_parity(tmp_path):
    """On a GPU: ``examples.lm.gpu_bench`` on tiny-llama, every method row of both systems,
    bf16 autocast; float32 logits of ours vs transformers on CUDA <= 1e-5 x scale, for LoRA and
    for QLoRA (ours' NF4 base against bitsandbytes' CUDA ``Linear4bit``), first losses equal up to
    bf16 rounding, and each row's peak GPU memory and plan filled in."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from examples.lm import gpu_bench

    out = tmp_path / "gpu.json"
    rc = gpu_bench.main(["--shape", "tiny-llama", "--batch", "2", "--block", "32", "--steps", "2", "--device", "cuda",
                         "--methods", ",".join(gpu_bench.METHODS), "--check-logits", "--json", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert rc == 0, result["table"]
    assert result["logits"]["logits_rel_err"] < 1e-5 and result["logits"]["qlora_logits_rel_err"] < 1e-5, result["logits"]
    rows = {(r["system"], r["method"]): r for r in result["rows"]}
    for (system, method), r in rows.items():
        assert r["peak_alloc_mb"] > 0 and r["plan_mb"] > 0, (system, method, r)
    for method in gpu_bench.METHODS:
        ours, hf = rows[("ours-torch", method)]["loss"][0], rows[("hf-peft", method)]["loss"][0]
        assert abs(ours - hf) <= 1e-2 * abs(hf), (method, ours, hf)


def test_gpu_bench_compiled_row(tmp_path):
    """``gpu_bench --compile``: ours-torch's step through torch.compile (aot_eager here, inductor
    on the GPU), two warm-up updates, the eager row's losses (HF's row stays eager); the eager
    run with ``--decode``."""
    from examples.lm import gpu_bench

    rows = {}
    for compiled in (False, True):
        out = tmp_path / f"gpu{compiled}.json"
        args = ["--shape", "tiny-llama", "--batch", "2", "--block", "16", "--steps", "2", "--device", "cpu",
                "--precision", "fp32", "--methods", "lora", "--json", str(out)] + \
            (["--compile", "aot_eager"] if compiled else ["--decode", "6"])  # fmt: skip
        assert gpu_bench.main(args) == 0
        result = json.loads(out.read_text())
        rows[compiled] = {r["system"]: r for r in result["rows"]}
        if not compiled:  # --decode: greedy on the device, ours against generate, the same tokens
            d = result["decode"]
            assert d["new_tokens"] == 6 and d["same_tokens"] and d["ours-torch_s"] > 0 and d["hf-peft_s"] > 0, d
            assert "greedy 2 x 6 tokens" in result["table"]
    ours, eager = rows[True]["ours-torch"], rows[False]["ours-torch"]
    assert ours["warmup_steps"] == 2 and eager["warmup_steps"] == 1 and rows[True]["hf-peft"]["warmup_steps"] == 1
    assert len(ours["loss"]) == 4 and len(eager["loss"]) == 3
    np.testing.assert_allclose(ours["loss"][:3], eager["loss"], rtol=1e-5)


def test_hf_qlora_weights_count_bitsandbytes_block_scales(tmp_path):
    """transformers + peft's QLoRA 'weights' part holds bitsandbytes' block scales (its
    Params4bit keeps them in quant_state, no buffer: they were counted as activations), as ours'
    4-bit layers hold theirs: the same checkpoint gives the same bytes within the scalars."""
    from examples.lm.bench import write_inputs
    from examples.lm.bench_shapes import shape_config, targets
    from examples.lm.bench_systems import make_system

    cfg = shape_config("tiny-llama")
    files = write_inputs(cfg, tmp_path)
    weights = {s: make_system(s, Path(files["ckpt"]), Path(files["lora_train"]), True, "qlora", targets(cfg))
               .memory_parts()["weights"] for s in ("hf-peft", "ours-torch")}  # fmt: skip
    assert abs(weights["hf-peft"] - weights["ours-torch"]) <= 64, weights  # 14 4-bit layers: 344 B of scales


@pytest.mark.parametrize("module, argv, message", [
    ("bench", ["--layers", "0"], "--layers must be >= 1 when given, got 0"),
    ("bench", ["--systems", "ours-torch,ours-torch"], "--systems: ['ours-torch'] named twice"),
    ("bench", ["--shape", "tiny-mistral", "--block", "80", "--new-tokens", "8"],
     "--shape tiny-mistral: sequence of 80 tokens exceeds sliding_window=64"),
    ("gpu_bench", ["--device", "cpu", "--block", "200"], "sequence of 200 tokens exceeds max_position_embeddings=128"),
    ("gpu_bench", ["--device", "cpu", "--steps", "0"], "--steps must be >= 1, got 0"),
    ("speed_ab", ["--batch", "0"], "--batch must be >= 1, got 0"),
    ("speed_ab", ["--block", "200"], "sequence of 200 tokens exceeds max_position_embeddings=128"),
    ("speed_ab", ["--threads", "0"], "--threads must be >= 1, got 0"),
    ("step_profile", ["--vocab", "0"], "--vocab must be >= 1 when given, got 0"),
])  # fmt: skip
def test_bench_sizes_refused_by_name(module, argv, message, capsys):
    """Sizes that fell back to the preset's (0 layers), ran a row twice as one row's repeats, or
    failed inside the rows (a block past the window or the positions) after the whole run."""
    import importlib

    main = importlib.import_module(f"examples.lm.{module}").main
    with pytest.raises(SystemExit):
        main(["--shape", "tiny-llama", *argv])
    assert message in capsys.readouterr().err
