"""The memory planner (lora_core.plan): its arithmetic on hand-checked cases, its refusals, the
``lora-plan`` console output, and its predictions against the committed methods bench JSONs."""

import json
from pathlib import Path

import numpy as np
import pytest

from lora_core.models.gpt2 import PRESETS as GPT2_PRESETS
from lora_core.models.llama import PRESETS, base_shapes
from lora_core.plan import PlanConfig, bench_plan, plan, resolve_model
from lora_core.plan.cli import main
from lora_core.plan.memory import MB, SYSTEMS

ROOT = Path(__file__).resolve().parents[1]
TINY = PRESETS["tiny-llama"]
N_TINY = sum(int(np.prod(s)) for s in base_shapes(TINY).values())


def test_full_ft_adamw_is_weights_grads_two_moments():
    p = plan(TINY, PlanConfig(method="full", batch=1, seq=8))
    assert p.params == N_TINY and p.trainable == N_TINY
    assert p.weights * MB == 4 * N_TINY and p.gradients * MB == 4 * N_TINY and p.optimizer * MB == 8 * N_TINY


def test_bf16_full_ft_is_zero_paper_16_bytes():
    p = plan(TINY, PlanConfig(method="full", precision="bf16", batch=1, seq=8))
    assert (p.weights + p.gradients + p.optimizer) * MB == 16 * N_TINY  # 2 + 2 + K=12


def test_lora_trainable_and_frozen_bytes():
    cfg = PRESETS["llama-bench"]
    p = plan(cfg, PlanConfig(method="lora", targets=("q_proj", "v_proj"), r=4, batch=1, seq=8))
    lora = cfg.num_hidden_layers * 4 * ((1024 + 1024) + (1024 + 256))
    assert p.trainable == lora and p.gradients * MB == 4 * lora and p.optimizer * MB == 8 * lora
    frozen = sum(int(np.prod(s)) for s in base_shapes(cfg).values())
    assert p.weights * MB == 4 * (frozen + lora)


def test_zero2_halves_gradients_and_optimizer_zero3_shards_weights():
    c = dict(method="full", batch=1, seq=8)
    p0, p2, p3 = (plan(TINY, PlanConfig(**c, zero=z, ranks=1 if z == 0 else 2)) for z in (0, 2, 3))
    assert p2.gradients == p0.gradients / 2 and p2.optimizer == p0.optimizer / 2 and p2.weights == p0.weights
    assert p3.gradients == p2.gradients and p3.weights < p0.weights


def test_gc_keeps_one_layer_input_per_layer():
    cfg = PRESETS["llama-bench"]
    c = dict(method="lora", batch=2, seq=16)
    on, off = plan(cfg, PlanConfig(**c, gc=True)), plan(cfg, PlanConfig(**c, gc=False))
    assert on.per_layer_gc * MB == 2 * 16 * cfg.hidden_size * 4
    L, scale = cfg.num_hidden_layers, SYSTEMS["ours-torch"].act_scale
    saved_off, saved_on = L * off.per_layer_nogc, L * on.per_layer_gc + on.per_layer_nogc
    assert off.activations - on.activations == pytest.approx((saved_off - saved_on) * scale, rel=1e-9)


def test_flops_six_n_full_four_n_lora():
    cfg = PRESETS["llama-3.1-8b"]
    full = plan(cfg, PlanConfig(method="full", batch=1, seq=1))
    lora = plan(cfg, PlanConfig(method="lora", batch=1, seq=1))
    n = full.params - cfg.vocab_size * cfg.hidden_size  # the weights multiplied (the embedding is a lookup)
    assert full.flops_per_token / n == pytest.approx(6, rel=0.01)
    assert lora.flops_per_token / n == pytest.approx(4, rel=0.01)


@pytest.mark.parametrize("kw, msg", [
    (dict(zero=2, ranks=1), "shards nothing"), (dict(zero=1, ranks=2), "ZeRO stage 1"),
    (dict(method="dora"), "method"), (dict(ranks=0), "ranks"), (dict(system="tpu"), "system"),
])  # fmt: skip
def test_refusals(kw, msg):
    with pytest.raises(ValueError, match=msg):
        PlanConfig(**kw)


def test_refuses_unknown_model_type_and_targets(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(ValueError, match="bert"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="preset"):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match="not projections"):
        plan(TINY, PlanConfig(targets=("c_attn",)))


def test_reads_config_json_and_gpt2(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    cfg, _ = resolve_model(str(tmp_path / "config.json"))
    assert plan(cfg, PlanConfig()).peak == plan(TINY, PlanConfig()).peak
    g = plan(GPT2_PRESETS["gpt2"], PlanConfig(method="lora", targets=("c_attn",), r=4))
    assert 124e6 < g.params < 125e6


def test_cli_prints_the_split(capsys):
    assert main(["--model", "llama-bench", "--method", "qlora", "--gc", "--zero", "2", "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    for word in (
        "per-rank peak",
        "weights",
        "gradients",
        "optimizer state",
        "activations",
        "framework overhead",
        "without GC",
        "LM head",
        "FLOPs per token",
    ):
        assert word in out
    with pytest.raises(SystemExit) as e:
        main(["--model", "llama-bench", "--zero", "3", "--ranks", "1"])
    assert e.value.code == 2 and "shards nothing" in capsys.readouterr().err


BENCH_JSONS = sorted((ROOT / "docs" / "bench").glob("lm_methods_*.json"))


@pytest.mark.parametrize("path", BENCH_JSONS, ids=[p.name for p in BENCH_JSONS])
def test_predictions_within_ten_percent_of_the_bench(path):
    d = json.loads(path.read_text())
    s, checked = d["settings"], 0
    for key, runs in d["raw"].items():
        system, _, method = key.partition(" ")
        for r in runs:
            measured = r.get("train_peak_private_mb")
            if measured is None:
                continue
            pred = bench_plan(s["shape"], s.get("layers"), s["batch"], s["block"], system, method or "lora").peak
            assert abs(pred - measured) / measured < 0.10, f"{key}: predicted {pred:.0f} MB, measured {measured:.0f} MB"
            checked += 1
    assert checked >= 2


def test_bench_jsons_committed():
    assert len(BENCH_JSONS) >= 2, "docs/bench/lm_methods_<shape>_<hash>.json: one per bench shape"


def test_methods_table_has_the_planner_column():
    from examples.lm.methods_table import rows, table_lines
    from examples.nlg.bench import _fmt

    d = json.loads(BENCH_JSONS[0].read_text())
    out = rows(d["summary"]["medians"], d["flops_per_token"], d["gemm"]["peak_gflops"], d["settings"])
    done = [r for r in out if r["private_mb"] is not None]
    assert done and all(abs(r["error_pct"]) < 10 for r in done)
    assert "pred MB" in table_lines(out, _fmt)[0] and "err %" in table_lines(out, _fmt)[0]
