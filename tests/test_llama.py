"""The Llama family (llama, llama3 RoPE scaling, mistral, qwen2) in both backends against
``transformers`` (and ``peft``), built as tiny random models saved in the test: config reading,
every checkpoint layout (sharded and not, safetensors and bin), logits padded and unpadded,
LoRA gradients vs peft, jittor vs torch LoRA training, greedy and beam decoding vs
``generate``, peft adapters both ways, and bad input refused by name."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from helpers import assert_close, to_numpy, write_torch_bin

import lora_core as lc
from lora_core.data.batching import collate
from lora_core.formats.tensor_files import CheckpointError
from lora_core.generate.beam import BeamConfig
from lora_core.models import llama as spec

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

V = 96
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
KINDS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True)),
    "llama3-tied": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, rope_scaling=LLAMA3, rope_theta=500000.0, tie_word_embeddings=True)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**dict(SMALL, num_key_value_heads=1),
                                                                                  head_dim=16, sliding_window=64)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL)),
}
# how each kind is saved: unsharded safetensors, sharded safetensors, pytorch_model.bin, sharded bin
LAYOUTS = {"llama": ("5GB", True), "llama3-tied": ("30KB", True), "mistral": ("5GB", False), "qwen2": ("30KB", False)}
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _randomize(model, seed):
    """Non-trivial norms and biases (transformers initialises them to 1 and 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):
                p.copy_(1.0 * (n.endswith("norm.weight")) + 0.1 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (transformers model, its checkpoint folder)."""
    root = tmp_path_factory.mktemp("llama")
    out = {}
    for i, (kind, make) in enumerate(KINDS.items()):
        torch.manual_seed(i)
        hf = make().eval()
        _randomize(hf, i)
        shard, safe = LAYOUTS[kind]
        hf.save_pretrained(root / kind, max_shard_size=shard)
        if not safe:
            _to_bin(hf, root / kind, sharded=shard != "5GB")
        out[kind] = (hf, root / kind)
    return out


def _to_bin(hf, d, sharded):
    """The ``torch.save`` layouts older transformers wrote (transformers 5 saves only
    safetensors): ``pytorch_model.bin``, or shards with ``pytorch_model.bin.index.json``."""
    for f in d.glob("model*.safetensors*"):
        f.unlink()
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    write_torch_bin(sd, d, 3 if sharded else 0)


def _ids(seed=0, B=3, T=19):
    ids = np.random.default_rng(seed).integers(0, V, (B, T)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, 12:] = 0
    mask[2, 7:] = 0
    return ids, mask


def test_checkpoint_layouts_are_the_ones_asked(checkpoints):
    names = {k: sorted(p.name for p in d.iterdir()) for k, (_, d) in checkpoints.items()}
    assert "model.safetensors" in names["llama"]
    assert "model.safetensors.index.json" in names["llama3-tied"] and len(names["llama3-tied"]) > 4
    assert "pytorch_model.bin" in names["mistral"]
    assert "pytorch_model.bin.index.json" in names["qwen2"]


@pytest.mark.parametrize("kind", list(KINDS))
def test_config_from_transformers(checkpoints, kind):
    hf, d = checkpoints[kind]
    cfg = spec.LlamaConfig.from_hf_json(d / "config.json")
    assert cfg.head_dim == getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads
    assert cfg.kv_groups == hf.config.num_attention_heads // hf.config.num_key_value_heads
    assert cfg.tie_word_embeddings == (kind == "llama3-tied")
    assert cfg.qkv_bias == (kind in ("llama", "qwen2")) and cfg.o_bias == (kind == "llama")
    # the RoPE frequencies transformers computes (default and llama3)
    rot = hf.model.rotary_emb
    assert_close(f"llama rope inv_freq {kind}", spec.rope_inv_freq(cfg), rot.inv_freq, 1e-7)
    # our config.json round-trips through transformers
    back = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    assert spec.LlamaConfig.from_hf_dict(back.to_dict()) == cfg


def test_v4_config_json_with_rope_scaling(tmp_path):
    """Llama 3.2's published config.json (transformers 4.x keys: rope_theta + rope_scaling)."""
    d = dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
             rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, hidden_act="silu",
             rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                           "original_max_position_embeddings": 8192, "rope_type": "llama3"})
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = spec.LlamaConfig.from_hf_json(tmp_path / "config.json")
    assert cfg == spec.PRESETS["llama-3.2-1b"].__class__(**{**spec.PRESETS["llama-3.2-1b"].to_dict(),
                                                           "bos_token_id": 1, "eos_token_id": 2})
    ref = transformers.LlamaConfig(**{k: v for k, v in d.items() if k != "model_type"})
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](ref, "cpu")
    assert_close("llama rope inv_freq llama3 (3.2-1B config)", spec.rope_inv_freq(cfg), inv, 1e-7)


def test_llama3_original_max_positions_as_transformers_reads_it():
    """transformers 5 (``standardize_rope_params``) takes a top-level
    ``original_max_position_embeddings`` over the llama3 rope dict's (Phi-3's layout), and
    ``max_position_embeddings`` where neither has one: the same RoPE frequencies here (the
    top-level key was ignored: logits 8.3 apart on a tiny model)."""
    base = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rope_theta=5e5)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    no_old = {k: v for k, v in rope.items() if k != "original_max_position_embeddings"}
    for d, old in ((dict(base, rope_scaling=rope, original_max_position_embeddings=64), 64),
                   (dict(base, rope_scaling=no_old), 128), (dict(base, rope_scaling=rope), 16)):
        ours = spec.LlamaConfig.from_hf_dict(copy.deepcopy(d))
        ref = transformers.LlamaConfig(**{k: v for k, v in copy.deepcopy(d).items() if k != "model_type"})
        # the model's config, standardized again once the top-level key is an attribute (the
        # config object's own rope_parameters still holds the dict's value)
        hf = transformers.LlamaForCausalLM(ref)
        assert ours.rope_scaling["original_max_position_embeddings"] == old
        assert hf.config.rope_parameters["original_max_position_embeddings"] == old
        inv = hf.model.rotary_emb.inv_freq
        assert_close(f"llama3 inv_freq, original positions {old}", spec.rope_inv_freq(ours), inv, 1e-7)


@pytest.mark.parametrize("mt", ["llama", "mistral", "qwen2"])
def test_fields_left_out_or_not_in_the_type_read_as_transformers_reads_them(mt):
    """A config.json that leaves a field out means transformers' default for its model type (they
    differ: Mistral's MLP width, key/value heads and window, Qwen2's vocabulary, ...); Mistral has
    no biases and Qwen2 no o/MLP biases whatever attention_bias and mlp_bias say. Parameter counts
    equal transformers' model of the same config."""
    from lora_core.plan.memory import PlanConfig, _params, arch_of

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}[mt]
    ours = spec.LlamaConfig.from_hf_dict({"model_type": mt})
    ref = cls()
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "rms_norm_eps"):
        assert getattr(ours, k) == getattr(ref, k), k
    assert ours.sliding_window == (ref.sliding_window if mt == "mistral" else None)
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, attention_bias=True, mlp_bias=True)  # fmt: skip
    ours = spec.LlamaConfig.from_hf_dict({"model_type": mt, **small})
    model = transformers.AutoModelForCausalLM.from_config(cls(**small))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight" or not ours.tie_word_embeddings}
    assert shapes == {k: tuple(v) for k, v in spec.base_shapes(ours).items()}
    assert _params(arch_of(ours), PlanConfig(method="full"))[0] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("mt", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("given", [{}, {"num_attention_heads": 64}, {"num_key_value_heads": None}],
                         ids=["all-left-out", "64-heads", "null-kv-heads"])  # fmt: skip
def test_token_ids_and_kv_heads_left_out_read_as_transformers_reads_them(tmp_path, mt, given):
    """A config.json without bos/eos_token_id and num_key_value_heads: transformers' values for its
    model type (Qwen2: no bos/eos, 32 key/value heads whatever num_attention_heads; Llama:
    num_attention_heads; Mistral: 8; a null: num_attention_heads), and through ``to_hf_dict``
    the same again (a Qwen2 config gains no eos 2). With no eos named, a tokenizer's own is
    accepted."""
    from lora_core.data.text import check_tokenizer_fits, model_eos_ids

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}[mt]
    if mt == "mistral" and given.get("num_key_value_heads", 0) is None:
        pytest.skip("transformers' MistralConfig refuses a null num_key_value_heads")
    d = {"model_type": mt, "vocab_size": 96, "hidden_size": 256, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 32, **given}
    (tmp_path / "config.json").write_text(json.dumps(d))
    ref = cls(**{k: v for k, v in d.items() if k != "model_type"}).to_dict()
    ours = spec.LlamaConfig.from_hf_json(tmp_path / "config.json")
    for k in ("bos_token_id", "eos_token_id", "num_key_value_heads", "num_attention_heads"):
        assert getattr(ours, k) == ref[k], k
    if mt == "qwen2":
        assert (ours.bos_token_id, ours.eos_token_id, ours.num_key_value_heads) == (None, None, 32)
    back = ours.to_hf_dict()
    assert {k: back[k] for k in ("bos_token_id", "eos_token_id")} == {k: ref[k] for k in ("bos_token_id", "eos_token_id")}
    again = cls(**{k: v for k, v in back.items() if k not in ("model_type", "architectures", "torch_dtype")})
    assert (again.bos_token_id, again.eos_token_id, again.num_key_value_heads) == \
        (ref["bos_token_id"], ref["eos_token_id"], ref["num_key_value_heads"])  # fmt: skip
    assert spec.LlamaConfig.from_hf_dict(back) == ours
    if ours.eos_token_id is None:
        assert model_eos_ids(ours) is None
        check_tokenizer_fits(96, 96, eos_id=95, model_eos=model_eos_ids(ours))  # accepted
    else:
        with pytest.raises(ValueError, match="names eos_token_id 2"):
            check_tokenizer_fits(96, 96, eos_id=95, model_eos=model_eos_ids(ours))


def test_left_out_kv_heads_that_do_not_divide_the_heads_are_named():
    d = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4}
    with pytest.raises(ValueError, match="num_key_value_heads is not set, and transformers' Qwen2Config then takes 32"):
        spec.LlamaConfig.from_hf_dict(d)
    assert spec.LlamaConfig.from_hf_dict({**d, "num_key_value_heads": None}).num_key_value_heads == 4


@pytest.mark.parametrize("kind", list(KINDS))
def test_logits_match_transformers(backend, checkpoints, kind):
    hf, d = checkpoints[kind]
    model = backend.from_pretrained(d)
    assert type(model).__name__ == "LlamaForCausalLM"
    ids, mask = _ids()
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)).logits
        ref_pad = hf(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits
    ours, _ = model(ids)
    assert_close(f"llama logits vs transformers ({kind})", to_numpy(ours), ref, 1e-5)
    ours_pad, _ = model(ids, attention_mask=mask)
    keep = mask.astype(bool)
    assert_close(f"llama logits vs transformers, padded ({kind})", to_numpy(ours_pad)[keep], ref_pad.numpy()[keep], 1e-5)
    # the training path: real tokens only
    batch = collate([(list(r[:1]), list(r[1:m.sum()]) + [0]) for r, m in zip(ids, mask)])
    h = model.hidden_unpadded(batch["input_ids"], batch["token_index"], batch["pad_index"])
    assert_close(f"llama unpadded logits vs transformers ({kind})", to_numpy(model.lm_logits(h)),
                 ref_pad.numpy()[keep], 1e-5)
    # the same with nothing padded (packed text blocks: no gather, no scatter)
    full = collate([(list(r[:1]), list(r[1:]) + [0]) for r in ids])
    h = model.hidden_unpadded(full["input_ids"], full["token_index"], full["pad_index"])
    assert_close(f"llama unpadded logits vs transformers, no padding ({kind})", to_numpy(model.lm_logits(h)),
                 ref.numpy().reshape(-1, V), 1e-5)


def _lm_batch(seed=3):
    ids, mask = _ids(seed)
    return collate([(list(r[:1]), list(r[1:m.sum()]) + [int(r[0])]) for r, m in zip(ids, mask)])


@pytest.mark.parametrize("kind", ["llama3-tied", "qwen2"])
def test_lora_gradients_match_peft(backend, checkpoints, kind):
    """LoRA on all seven projections (B non-zero) : loss and every LoRA gradient vs peft's."""
    hf, d = checkpoints[kind]
    tc = lc.LoRATargetConfig(r=4, alpha=8.0, target_modules=PROJ, seed=5)
    model = backend.from_pretrained(d)
    backend.inject_lora(model, tc)
    rng = np.random.default_rng(1)
    vals = {n: (rng.normal(0, 0.2, p.shape) if "lora_B" in n else to_numpy(p)).astype(np.float32)
            for n, p in backend.trainable_parameters(model).items()}
    model.load_partial(vals)
    batch = _lm_batch()
    loss = backend.lm_loss(model, batch)
    grads = _grads(backend, model, loss)
    ref_loss, ref_grads = _peft_loss_and_grads(copy.deepcopy(hf), vals, batch)
    assert_close(f"llama LoRA loss vs peft ({kind})", float(to_numpy(loss)), ref_loss, 1e-6)
    assert set(grads) == set(ref_grads)
    worst = max(assert_close(f"llama LoRA grad vs peft ({kind})", grads[n], ref_grads[n], 1e-5) for n in grads)
    assert worst <= 1e-5


def _peft_loss_and_grads(hf, vals: dict, batch: dict, device: str = "cpu"):
    """peft LoRA (r=4, alpha 8, the seven projections) on ``hf`` (a transformers model on
    ``device``) with our LoRA values ``vals``: the loss on ``batch`` and every LoRA gradient by
    our names."""
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(PROJ)))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.from_numpy(vals[_ours(n)]))
    pm.train()
    t = {k: torch.from_numpy(batch[k]).to(device) for k in ("input_ids", "loss_index", "targets")}
    logits = pm(t["input_ids"]).logits.reshape(-1, V)
    ref_loss = torch.nn.functional.cross_entropy(logits[t["loss_index"]], t["targets"])
    ref_loss.backward()
    return ref_loss.item(), {_ours(n): to_numpy(p.grad) for n, p in pm.named_parameters() if p.requires_grad}


def _ours(peft_name: str) -> str:
    """peft's parameter name -> ours (``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A``)."""
    return peft_name.replace("base_model.model.", "", 1).replace(".default.weight", "")


def _grads(backend, model, loss):
    params = backend.trainable_parameters(model)
    if backend.NAME == "torch":
        loss.backward()
        return {n: p.grad.numpy() for n, p in params.items()}
    import jittor as jt

    gs = jt.grad(loss, list(params.values()))
    return {n: g.numpy() for n, g in zip(params, gs)}


@pytest.fixture(scope="module")
def torch_curve(checkpoints):
    return _train_curve(lc.get_backend("torch"), checkpoints["qwen2"][1])


def _train_curve(bk, d, steps=20):
    from lora_core.train.optim import AdamWConfig

    model = bk.from_pretrained(d)
    bk.inject_lora(model, lc.LoRATargetConfig(r=4, alpha=16.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
                                              seed=2))
    opt = bk.AdamW(bk.trainable_parameters(model), AdamWConfig(weight_decay=0.01))
    losses = [bk.train_step(model, opt, [_lm_batch(s % 4)], 2e-3, max_grad_norm=1.0)["loss"] for s in range(steps)]
    return np.array(losses), {n: to_numpy(p) for n, p in bk.trainable_parameters(model).items()}


def test_jittor_matches_torch_over_20_lora_updates(checkpoints, torch_curve):
    bj = pytest.importorskip("lora_core").get_backend("jittor")
    loss_t, w_t = torch_curve
    loss_j, w_j = _train_curve(bj, checkpoints["qwen2"][1])
    assert loss_t[-1] < loss_t[0]  # it learns
    assert_close("llama jittor vs torch: 20-update LoRA loss curve", loss_j, loss_t, 1e-5)
    for n in w_t:
        assert_close("llama jittor vs torch: LoRA weights after 20 updates", w_j[n], w_t[n], 1e-5)


def _hf_generate(hf, ctx, **kw):
    out = hf.generate(torch.tensor([ctx]), attention_mask=torch.ones(1, len(ctx), dtype=torch.long), do_sample=False,
                      max_new_tokens=10, eos_token_id=None, pad_token_id=0, **kw)
    return out[0, len(ctx):].tolist()


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_greedy_and_beam_match_generate(backend, checkpoints, kind):
    """KV-cached decoding, contexts of different lengths batched (left-padded inside) vs
    ``generate`` on each context alone: greedy and 3-beam outputs identical."""
    hf, d = checkpoints[kind]
    model = backend.from_pretrained(d)
    rng = np.random.default_rng(4)
    ctxs = [rng.integers(1, V, n).tolist() for n in (5, 9, 3)]
    greedy = backend.beam_search(model, ctxs, BeamConfig(beam=1, max_new_tokens=10, no_repeat_ngram_size=0,
                                                         stop_ids=()), batch_size=3)
    assert greedy == [_hf_generate(hf, c) for c in ctxs]
    beams = backend.beam_search(model, ctxs, BeamConfig(beam=3, max_new_tokens=10, no_repeat_ngram_size=0,
                                                        stop_ids=()), batch_size=3)
    assert beams == [_hf_generate(hf, c, num_beams=3) for c in ctxs]


def test_lora_greedy_and_beam_match_peft_generate(backend, checkpoints, tmp_path):
    """A peft adapter on q_proj and v_proj (B non-zero; q, k, v with biases): ours' greedy and
    3-beam outputs are peft's ``generate``'s. The attention block's q, k and v run as one
    stacked product while decoding (the group has a LoRA update: its weights are copies
    anyway), k's frozen weight and the three biases stacked with them; the logits inside
    ``decoding`` are the plain path's, for the few rows of greedy decoding and the many of beams."""
    hf, d = checkpoints["llama"]
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                               init_lora_weights=False)).eval()
    pm.save_pretrained(tmp_path / "peft")
    model = backend.from_pretrained(d, adapter=tmp_path / "peft")
    rng = np.random.default_rng(6)
    ctxs = [rng.integers(1, V, n).tolist() for n in (5, 9, 3)]
    for beam in (1, 3):
        bc = BeamConfig(beam=beam, max_new_tokens=10, no_repeat_ngram_size=0, stop_ids=())
        ref = [_hf_generate(pm, c, **({"num_beams": beam} if beam > 1 else {})) for c in ctxs]
        assert backend.beam_search(model, ctxs, bc, batch_size=3) == ref
    ids, _ = _ids(6)
    plain = to_numpy(model(ids)[0])
    attn = model.model.layers[0].self_attn
    for rows in (2, 80):
        with model.decoding(rows=rows):
            assert attn.decode_fused is not None and attn.q_proj.decode_weight is None
            assert model.model.layers[0].mlp.up_proj.decode_weight is not None
            got = to_numpy(model(ids)[0])
        assert_close(f"llama fused q, k, v in decoding({rows}) vs plain ({backend.NAME})", got, plain, 1e-5)
        assert attn.decode_fused is None


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_captured_decode_step_gives_generate_beams(checkpoints, kind):
    """torch: beam search's decode step on the preallocated cache (the step a GPU records once
    per shape as a CUDA graph: ``decode_step`` "auto" there) with grouped-query heads (2 and 1
    key/value heads), RoPE read at each row's position on the device: ``generate``'s greedy and
    beam outputs, op by op and through a stand-in of the CUDA graph recorder; the config's
    length bound (Mistral's ``sliding_window``) is refused as with the growing cache."""
    from test_beam import ReplayRecorder, captured_search

    bt = lc.get_backend("torch")
    hf, d = checkpoints[kind]
    model = bt.from_pretrained(d)
    rng = np.random.default_rng(4)
    ctxs = [rng.integers(1, V, n).tolist() for n in (5, 9, 3)]
    for beam in (1, 3):
        bc = BeamConfig(beam=beam, max_new_tokens=10, no_repeat_ngram_size=0, stop_ids=())
        ref = [_hf_generate(hf, c, **({"num_beams": beam} if beam > 1 else {})) for c in ctxs]
        assert bt.beam_search(model, ctxs, bc, batch_size=3, decode_step="captured") == ref
        rec = ReplayRecorder()
        out, static = captured_search(model, ctxs, bc, 3, rec)
        assert out == ref and static.captures == 1 and rec.replays == bc.max_new_tokens - 1
    limit, name = (64, "sliding_window") if kind == "mistral" else (128, "max_position_embeddings")
    # a prompt whose rounded-up capacity plus the new slots passes the limit, the positions read not
    near = [[1 + i % (V - 1) for i in range(limit - 12)]]
    bc = BeamConfig(beam=2, max_new_tokens=10, no_repeat_ngram_size=0, stop_ids=())
    assert bt.beam_search(model, near, bc, decode_step="captured") == bt.beam_search(model, near, bc, decode_step="eager") \
        == [_hf_generate(hf, near[0], num_beams=2)]  # fmt: skip
    long = [[1 + i % (V - 1) for i in range(limit - 6)], [3, 4]]
    for step in ("eager", "captured"):
        with pytest.raises(ValueError, match=f"exceeds? {name}={limit}"):
            bt.beam_search(model, long, BeamConfig(beam=2, max_new_tokens=10, stop_ids=()), decode_step=step)


def test_peft_adapter_both_ways(backend, checkpoints, tmp_path):
    hf, d = checkpoints["llama"]
    ids, _ = _ids(6)
    # peft -> ours
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                                               init_lora_weights=False)).eval()
    pm.save_pretrained(tmp_path / "peft")
    with torch.no_grad():
        ref = pm(torch.from_numpy(ids)).logits
    ours = backend.from_pretrained(d, adapter=tmp_path / "peft")
    assert_close("llama peft adapter -> ours: logits", to_numpy(ours(ids)[0]), ref, 1e-5)
    # ours -> peft
    model = backend.from_pretrained(d)
    backend.inject_lora(model, lc.LoRATargetConfig(r=2, alpha=4.0, target_modules=("v_proj", "gate_proj", "o_proj")))
    rng = np.random.default_rng(2)
    model.load_partial({n: rng.normal(0, 0.3, p.shape).astype(np.float32)
                        for n, p in backend.trainable_parameters(model).items()})
    backend.save_lora_adapter(model, tmp_path / "ours", format="peft")
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours").eval()
    with torch.no_grad():
        ref = theirs(torch.from_numpy(ids)).logits
    assert_close("llama our adapter -> peft: logits", to_numpy(model(ids)[0]), ref, 1e-5)


def test_bad_configs_refused_by_name(tmp_path):
    base = dict(model_type="llama", **SMALL)
    for change, words in (({"model_type": "falcon"}, "model_type 'falcon'"),
                          ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
                          ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
                          ({"num_key_value_heads": 3}, "num_key_value_heads=3")):
        with pytest.raises(ValueError, match=words):
            spec.LlamaConfig.from_hf_dict({**base, **change})
    # a causal LM of another family: the error lists the supported types, whichever reader meets it
    (tmp_path / "neox").mkdir()
    (tmp_path / "neox" / "config.json").write_text(json.dumps({**base, "model_type": "gpt_neox"}))
    from lora_core.models.build import checkpoint_family
    from lora_core.models.gpt2 import GPT2Config

    assert checkpoint_family(tmp_path / "neox") == "gpt2"  # GPT-2's loader meets it
    with pytest.raises(ValueError, match=r"model_type 'gpt_neox' is not supported.*'gpt2', 'llama', 'mistral', 'qwen2'"):
        GPT2Config.from_hf_json(str(tmp_path / "neox" / "config.json"))
    # both fields set (a v5 file with a legacy rope_scaling left in): transformers takes rope_scaling
    both = {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}
    assert transformers.LlamaConfig(**copy.deepcopy(both)).rope_parameters["rope_type"] == "yarn"
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        spec.LlamaConfig.from_hf_dict(both)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32}
    both = {**base, "rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_scaling": llama3}
    theirs = transformers.LlamaConfig(**copy.deepcopy(both)).rope_parameters
    ours = spec.LlamaConfig.from_hf_dict(both)
    assert theirs["rope_type"] == "llama3" and ours.rope_scaling == {k: v for k, v in llama3.items() if k != "rope_type"}
    assert ours.rope_theta == theirs["rope_theta"] == 5e5
    cfg = spec.llama_config("tiny-mistral")
    with pytest.raises(ValueError, match="sliding_window=64"):
        spec.check_length(cfg, 65)


def test_damaged_checkpoints_name_the_file(checkpoints, tmp_path):
    import shutil

    src = checkpoints["llama3-tied"][1]
    d = tmp_path / "sharded"
    shutil.copytree(src, d)
    shards = sorted(d.glob("model-*.safetensors"))
    # a shard cut short
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=shards[1].name):
        spec.load_llama_checkpoint(d)
    # a shard missing
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=f"shard {shards[1].name} is missing"):
        spec.load_llama_checkpoint(d)
    # a tensor of the wrong shape, and one missing (strict, both listed)
    one = tmp_path / "one"
    shutil.copytree(checkpoints["llama"][1], one)
    from safetensors.numpy import load_file, save_file

    t = load_file(one / "model.safetensors")
    t["model.norm.weight"] = np.ones(7, np.float32)
    del t["model.layers.1.mlp.up_proj.weight"]
    save_file(t, one / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        spec.load_llama_checkpoint(one)
    assert "model.layers.1.mlp.up_proj.weight" in str(e.value) and "model.norm.weight: file (7,)" in str(e.value)


def test_presets_have_the_published_sizes():
    """Parameter counts of the real models (Meta's model cards: 1.24B, 3.21B, 8.03B)."""
    counts = {k: sum(int(np.prod(s)) for s in spec.base_shapes(spec.PRESETS[k]).values())
              for k in ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b")}
    assert round(counts["llama-3.2-1b"] / 1e9, 2) == 1.24
    assert round(counts["llama-3.2-3b"] / 1e9, 2) == 3.21
    assert round(counts["llama-3.1-8b"] / 1e9, 2) == 8.03


def test_lora_on_embeddings_head_rslora_and_patterns_loads_from_peft(backend, checkpoints, tmp_path):
    """peft LoRA on ``embed_tokens`` and ``lm_head`` too, rsLoRA, per-module ranks and alphas:
    the adapter loads into our model with peft's logits."""
    hf, d = checkpoints["llama"]
    pcfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj", "embed_tokens", "lm_head"],
                           rank_pattern={"up_proj": 2}, alpha_pattern={"lm_head": 3}, use_rslora=True,
                           init_lora_weights=False)
    pm = peft.get_peft_model(copy.deepcopy(hf), pcfg).eval()
    pm.save_pretrained(tmp_path / "peft")
    ids, _ = _ids(8)
    with torch.no_grad():
        ref = pm(torch.from_numpy(ids)).logits
    ours = backend.from_pretrained(d, adapter=tmp_path / "peft")
    assert_close("llama peft adapter (embeddings, head, rsLoRA, patterns) -> ours", to_numpy(ours(ids)[0]), ref, 1e-5)


def test_compiled_training_step_matches_eager(checkpoints):
    """torch ``set_compile`` on a Llama (aot_eager: the captured forward and backward, fast to
    compile): the same losses and LoRA weights as the eager step over 3 updates."""
    from lora_core.train.optim import AdamWConfig

    bt = lc.get_backend("torch")
    runs = []
    for compiled in (False, True):
        model = bt.from_pretrained(checkpoints["qwen2"][1])
        bt.inject_lora(model, lc.LoRATargetConfig(r=4, alpha=8.0, target_modules=PROJ, seed=1))
        if compiled:
            bt.set_compile(model, True, "aot_eager")
        opt = bt.AdamW(bt.trainable_parameters(model), AdamWConfig())
        losses = [bt.train_step(model, opt, [_lm_batch(s)], 1e-3)["loss"] for s in range(3)]
        runs.append((np.array(losses), {n: to_numpy(p) for n, p in bt.trainable_parameters(model).items()}))
    assert_close("llama compiled vs eager step: losses", runs[1][0], runs[0][0], 1e-6)
    for n in runs[0][1]:
        assert_close("llama compiled vs eager step: LoRA weights", runs[1][1][n], runs[0][1][n], 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("kind", ["llama3-tied", "mistral"])
def test_cuda_matches_transformers(checkpoints, kind):
    """On a GPU (torch), against transformers' model on the same GPU: float32 logits, padded
    and unpadded, <= 1e-5 x scale; LoRA loss and gradients vs peft <= 1e-5 relative; greedy and
    beam outputs (the captured decode step, "auto" on a GPU) identical to ``generate``'s."""
    bt = lc.get_backend("torch")
    hf, d = checkpoints[kind]
    hf = copy.deepcopy(hf).cuda()
    model = bt.from_pretrained(d)
    bt.to_device(model, "cuda")
    ids, mask = _ids()
    ids_t, mask_t = torch.from_numpy(ids).cuda(), torch.from_numpy(mask).cuda()
    with torch.no_grad():
        ref, ref_pad = hf(ids_t).logits, hf(ids_t, attention_mask=mask_t).logits
    assert_close(f"CUDA llama logits vs transformers ({kind})", to_numpy(model(ids_t)[0]), to_numpy(ref), 1e-5)
    keep = mask.astype(bool)
    assert_close(f"CUDA llama logits vs transformers, padded ({kind})", to_numpy(model(ids_t, attention_mask=mask_t)[0])[keep],
                 to_numpy(ref_pad)[keep], 1e-5)
    rng = np.random.default_rng(4)
    ctxs = [rng.integers(1, V, n).tolist() for n in (5, 9, 3)]
    for beam in (1, 3):
        bc = BeamConfig(beam=beam, max_new_tokens=10, no_repeat_ngram_size=0, stop_ids=())
        want = []
        for c in ctxs:
            out = hf.generate(torch.tensor([c]).cuda(), attention_mask=torch.ones(1, len(c), dtype=torch.long).cuda(),
                              do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0,
                              **({"num_beams": beam} if beam > 1 else {}))
            want.append(out[0, len(c):].tolist())
        assert bt.beam_search(model, ctxs, bc, batch_size=3) == want, (kind, beam)
    # LoRA gradients vs peft, both on the GPU
    tc = lc.LoRATargetConfig(r=4, alpha=8.0, target_modules=PROJ, seed=5)
    bt.inject_lora(model, tc)
    vals = {n: (rng.normal(0, 0.2, p.shape) if "lora_B" in n else to_numpy(p)).astype(np.float32)
            for n, p in bt.trainable_parameters(model).items()}
    model.load_partial(vals)
    model.train()
    batch = _lm_batch()
    loss = bt.lm_loss(model, batch)
    loss.backward()
    grads = {n: to_numpy(p.grad) for n, p in bt.trainable_parameters(model).items()}
    ref_loss, ref_grads = _peft_loss_and_grads(hf, vals, batch, "cuda")
    assert_close(f"CUDA llama LoRA loss vs peft ({kind})", float(to_numpy(loss)), ref_loss, 1e-5)
    assert set(grads) == set(ref_grads)
    for n in grads:
        assert_close(f"CUDA llama LoRA grad vs peft ({kind}) {n}", grads[n], ref_grads[n], 1e-5)


def test_merge_refused_where_the_head_is_tied_to_an_adapted_embedding(backend):
    """A tied head reads the base embedding table while LoRA is unmerged (as transformers + peft);
    merging the embedding's update would change the head too (logits 13 apart): refused, and an
    untied model merges with unchanged logits."""
    from lora_core import LoRATargetConfig

    for tied in (True, False):
        cfg = spec.llama_config("tiny-llama", tie_word_embeddings=tied)
        model = backend.LlamaForCausalLM(cfg)
        model.load_weights(spec.init_llama_weights(cfg, 0))
        backend.inject_lora(model, LoRATargetConfig(r=2, alpha=4, target_modules=["embed_tokens", "q_proj"]))
        for n, p in model.named_parameters():  # nonzero updates (B starts at zero)
            if "lora_" in n:
                p.assign(p + 0.5) if backend.NAME == "jittor" else p.data.add_(0.5)
        model.eval()
        ids = _ids()[0]
        before = to_numpy(model(ids)[0])
        if tied:
            with pytest.raises(ValueError, match="tied to model.embed_tokens, which has LoRA"):
                backend.merge_lora(model)
        else:
            backend.merge_lora(model)
            assert np.abs(to_numpy(model(ids)[0]) - before).max() <= 1e-5 * max(1.0, np.abs(before).max())
