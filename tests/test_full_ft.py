"""Full fine-tuning (``TrainConfig.method = "full"``, issue 22 item 1): every weight's gradient
against transformers' own after one backward pass (GPT-2, Llama), jittor vs torch loss curves,
checkpoints that transformers and our ``from_pretrained`` load, which weights take decay, exact
resume after a kill, and the train commands' refusals of LoRA-only input. Tiny shapes."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from helpers import assert_close, toy_train_args

import lora_core
from examples.cls import train as cls_cli
from examples.lm import train as lm_cli
from examples.nlg import train as nlg_cli
from lora_core.data.batching import collate
from lora_core.models import distilbert as dspec
from lora_core.models import llama as lspec
from lora_core.models.gpt2 import TRANSPOSED
from lora_core.train.optim import AdamWConfig, decays
from lora_core.train.recipes import RECIPES, TrainConfig
from lora_core.train.tasks import ClassificationTask
from lora_core.train.trainer import train

V, C, T = 96, 5, 7  # vocabulary, context and completion lengths (equal rows: no padding)


def _hf_gpt2(path):
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.save_pretrained(path)
    return model


def _hf_llama(path):
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1 so their gradients are checked in earnest
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


HF_MODELS = {"gpt2": _hf_gpt2, "llama": _hf_llama}


def _pairs(n: int, seed: int = 0, vocab: int = V) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, C).tolist(), rng.integers(0, vocab, T).tolist()) for _ in range(n)]


def _ours_to_hf(family: str, name: str, g: np.ndarray) -> tuple[str, np.ndarray]:
    if family == "gpt2":
        return "transformer." + name, g.T if name.endswith(TRANSPOSED) else g
    return name, g


@pytest.mark.parametrize("family", sorted(HF_MODELS))
def test_full_ft_gradients_of_every_weight_match_transformers(backend, family, tmp_path):
    hf = HF_MODELS[family](tmp_path / "hf")
    model = backend.from_pretrained(tmp_path / "hf")
    pairs = _pairs(3)
    # transformers: the completion tokens' mean NLL, one backward
    seq = torch.tensor([c + t for c, t in pairs])
    logits = hf(input_ids=seq[:, :-1]).logits[:, C - 1 :]
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, V), seq[:, C:].reshape(-1))
    ref.backward()
    ref_grads = {n: p.grad.numpy() for n, p in hf.named_parameters()}
    # ours: every parameter trains, AdamW's backward accumulates the gradients
    params = backend.trainable_parameters(model)
    assert set(params) == set(model.state_numpy())
    opt = backend.AdamW(params, AdamWConfig())
    model.train()
    loss = backend.lm_loss(model, collate(pairs), 0.0)
    opt.backward(loss)
    assert_close(f"full-FT loss vs transformers, {family} [{backend.NAME}]", float(loss.item()), ref.item(), 1e-6)
    grads = dict(_ours_to_hf(family, n, g) for n, g in opt.grads_numpy().items())
    assert set(grads) == set(ref_grads)
    for n in ref_grads:
        assert_close(f"full-FT grad vs transformers, {family} [{backend.NAME}]", grads[n], ref_grads[n], 1e-5)


def _gpt2(bk, seed=0):
    cfg = lora_core.gpt2_config("tiny", vocab_size=V)
    return bk.build_model(cfg, None, base=lora_core.init_gpt2_weights(cfg, seed))


def _llama(bk, seed=0, tied=False):
    cfg = lspec.llama_config("tiny-llama", vocab_size=V, tie_word_embeddings=tied)
    model = bk.LlamaForCausalLM(cfg)
    model.load_weights(lspec.init_llama_weights(cfg, seed))
    return model


def _distilbert(bk, seed=0):
    cfg = dataclasses.replace(dspec.PRESETS["tiny"], dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0)
    model = bk.DistilBertForSequenceClassification(cfg)
    model.load_weights(dspec.init_weights(cfg, seed))
    return model


FULL = TrainConfig(method="full", batch_size=4, lr=2e-3, warmup=2, weight_decay=0.05, label_smooth=0.1,
                   eval_every=0, save_every=10, log_every=1, seed=3)


def _losses(out_dir) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out_dir / "log.jsonl").read_text().splitlines()) if r["kind"] == "train"]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_jittor_and_torch_full_ft_loss_curves_agree(family, tmp_path):
    build = {"gpt2": _gpt2, "llama": _llama}[family]
    curves = {}
    for name in ("torch", "jittor"):
        bk = lora_core.get_backend(name)
        train(bk, build(bk), _pairs(24), None, FULL, tmp_path / name, max_steps=20, progress=False)
        curves[name] = _losses(tmp_path / name)
    assert len(curves["torch"]) == 20
    assert_close(f"full-FT 20-update loss curve jittor vs torch, {family}", curves["jittor"], curves["torch"], 1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama", "llama-tied", "distilbert"])
def test_full_ft_checkpoint_loads_into_transformers_and_ours(backend, family, tmp_path):
    cls = family == "distilbert"
    model = {"gpt2": _gpt2, "llama": _llama, "llama-tied": lambda b: _llama(b, tied=True),
             "distilbert": _distilbert}[family](backend)
    data = [(ids, len(ids) % 2) for ids, _ in _pairs(8)] if cls else _pairs(8)
    cfg = dataclasses.replace(FULL, label_smooth=0.0) if cls else FULL  # classification: no smoothing
    out = train(backend, model, data, None, cfg, tmp_path / "run", max_steps=3, progress=False,
                task=ClassificationTask() if cls else None)
    ckpt = tmp_path / "run" / "ckpt-3"
    assert out["checkpoint"] == str(ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "model.safetensors", "trainer_state.json",
                                                      "trainer_state.safetensors"]
    # the run folder, or its latest file, means its latest checkpoint (examples.lm.evaluate --base RUN)
    from lora_core.train.run_dir import checkpoint_of

    assert checkpoint_of(tmp_path / "run") == checkpoint_of(tmp_path / "run" / "latest") == checkpoint_of(ckpt) == ckpt
    ours = backend.distilbert_from_pretrained(ckpt) if cls else backend.from_pretrained(checkpoint_of(tmp_path / "run"))
    trained = model.state_numpy()
    assert all(np.array_equal(v, trained[n]) for n, v in ours.state_numpy().items())
    ids = np.array([c + t for c, t in _pairs(2, seed=5)])
    auto = transformers.AutoModelForSequenceClassification if cls else transformers.AutoModelForCausalLM
    hf = auto.from_pretrained(ckpt, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(ids)).logits.numpy()
    ours.eval()
    if cls:  # DistilBERT's forward takes the framework's tensors
        got = ours(torch.from_numpy(ids) if backend.NAME == "torch" else __import__("jittor").array(ids))
    else:
        got = ours(ids)[0]
    assert_close(f"full-FT checkpoint logits, ours vs transformers, {family} [{backend.NAME}]", got, ref, 1e-5)


def test_weight_decay_on_matrices_only_unless_asked():
    bk = lora_core.get_backend("torch")
    for model in (_gpt2(bk), _llama(bk), _distilbert(bk)):
        shapes = {n: v.shape for n, v in model.state_numpy().items()}
        decayed = {n for n, s in shapes.items() if decays(n, s, "matrices")}
        embeddings = {n for n in shapes if "embed" in n or n in ("wte.weight", "wpe.weight")}
        assert embeddings and decayed == {n for n, s in shapes.items() if len(s) == 2} - embeddings
    assert FULL.adamw_config().decay == "matrices"
    assert dataclasses.replace(FULL, decay_all=True).adamw_config().decay == "all"
    assert TrainConfig().adamw_config().decay == "all"  # LoRA: the paper code decays every trained tensor
    with pytest.raises(ValueError, match="decay_all"):
        TrainConfig(decay_all=True)
    with pytest.raises(ValueError, match="TrainConfig.method must be 'lora' or 'full', got 'qlora'"):
        TrainConfig(method="qlora")
    ft = RECIPES["e2e-medium-ft"]
    assert (ft.model, ft.train.method, ft.train.batch_size, ft.train.lr, ft.train.epochs) == ("gpt2-medium", "full",
                                                                                              5, 5e-5, 5)


def test_one_full_ft_update_decays_matrices_only(backend, tmp_path):
    """An update with zero gradients moves only what decays, by ``lr * weight_decay * p``."""
    model = _llama(backend)
    before = model.state_numpy()
    opt = backend.AdamW(backend.trainable_parameters(model), FULL.adamw_config())
    opt.step(0.5)
    after = model.state_numpy()
    for n, v in before.items():
        want = v * (1 - 0.5 * FULL.weight_decay) if decays(n, v.shape, "matrices") else v
        np.testing.assert_allclose(after[n], want, rtol=1e-6, err_msg=n)


def test_refuses_a_model_with_lora(backend, tmp_path):
    cfg = lora_core.gpt2_config("tiny", vocab_size=V)
    model = backend.build_model(cfg, FULL.lora_config(), base=lora_core.init_gpt2_weights(cfg, 0))
    with pytest.raises(ValueError, match="method='full' trains every weight of a model without LoRA"):
        train(backend, model, _pairs(4), None, FULL, tmp_path / "run", max_steps=1, progress=False)


# --------------------------------------------------------------------------- the commands


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from lora_core.data.convert import convert
    from lora_core.data.nlg import write_jsonl_atomic
    from lora_core.data.tokenizer import encode_file, load_tokenizer
    from lora_core.data.toy import make_toy_dataset

    d = tmp_path_factory.mktemp("toy")
    paths = make_toy_dataset(d)
    tok = load_tokenizer(paths["tokenizer"])
    out = {"vocab_size": tok.vocab_size}
    for split, n in (("train", 40), ("valid", 8)):
        out[split] = d / f"{split}.jsonl"
        write_jsonl_atomic(out[split], encode_file(tok, convert("e2e", paths[split])[:n]))
    return out


SETTINGS = ["batch_size=4", "warmup=2", "save_every=3", "eval_every=3", "log_every=1", "lr=1e-3"]


def _nlg(backend_name, toy, out_dir, *extra, ok=True):
    """The train command through ``sh`` (jittor, once imported here, quick-exits this process on
    SIGCHLD from a child killed by a signal: see tests/test_train.py), one thread."""
    args = ["--backend", backend_name, "--method", "full", *toy_train_args(toy, out_dir, 8, SETTINGS), *extra]
    cmd = ["sh", "-c", '"$@"; exit $?', "sh", sys.executable, "-m", "examples.nlg.train", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == (0 if ok else 128 + signal.SIGKILL), r.stdout + r.stderr
    return r


def test_resume_after_kill_is_exact_for_full_ft(backend, toy, tmp_path):
    _nlg(backend.NAME, toy, tmp_path / "whole")
    _nlg(backend.NAME, toy, tmp_path / "cut", "--stop-after", "4", ok=False)  # SIGKILL after update 4
    assert (tmp_path / "cut" / "ckpt-3").is_dir() and not (tmp_path / "cut" / "ckpt-6").exists()
    _nlg(backend.NAME, toy, tmp_path / "cut", "--resume")
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "whole")
    whole = backend.from_pretrained(tmp_path / "whole" / "ckpt-8").state_numpy()
    cut = backend.from_pretrained(tmp_path / "cut" / "ckpt-8").state_numpy()
    assert all(np.array_equal(cut[n], whole[n]) for n in whole)


def _refused(main, argv, capsys, expected: str) -> None:
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err == f"error: {expected}\n", err


def test_commands_refuse_lora_input_to_full_ft(toy, tmp_path, capsys):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    why = "an adapter folder (adapter_config.json), but --method full trains a whole model: give the base " \
          "checkpoint it was trained on"
    nlg = ["--method", "full", *toy_train_args(toy, tmp_path / "o1", 2, SETTINGS)]
    i = nlg.index("--random-init")
    with_adapter = nlg[:i] + ["--init-checkpoint", str(adapter)] + nlg[i + 2 :]
    with_adapter.remove("--vocab-size"), with_adapter.remove(str(toy["vocab_size"]))
    _refused(nlg_cli.main, with_adapter, capsys, f"--init-checkpoint {adapter}: {why}")
    _refused(nlg_cli.main, [*nlg, "lora_r=8"], capsys,
             "--set lora_r=8: a LoRA setting, but --method full trains every weight and has no LoRA")
    prepared = tmp_path / "prepared"  # never read: the refusals come first
    _refused(lm_cli.main, ["--method", "full", "--prepared", str(prepared), "--init-checkpoint", str(adapter),
                           "--out-dir", str(tmp_path / "o2")], capsys, f"--init-checkpoint {adapter}: {why}")
    _refused(lm_cli.main, ["--method", "full", "--prepared", str(prepared), "--random-init", "tiny-llama",
                           "--out-dir", str(tmp_path / "o3"), "--set", "lora.r=16"], capsys,
             "--set lora.r=16: a LoRA setting, but --method full trains every weight and has no LoRA")
    _refused(cls_cli.main, ["--method", "full", "--prepared", str(prepared), "--base", str(adapter),
                            "--out-dir", str(tmp_path / "o4")], capsys, f"--base {adapter}: {why}")
    assert not any((tmp_path / f"o{k}").exists() for k in range(1, 5))
    # a bitsandbytes 4-bit checkpoint loads 4-bit without --quantize: a frozen base (it trained the
    # embeddings and norms only, and saved checkpoints without the projections)
    four = tmp_path / "four"
    four.mkdir()
    (four / "config.json").write_text('{"model_type": "llama", "quantization_config": {"quant_method": '
                                      '"bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type": "nf4"}}')
    why4 = "a bitsandbytes 4-bit checkpoint (quantization_config in its config.json), a frozen base that " \
           "--method full cannot train: use --method lora (QLoRA), or a full-precision checkpoint"
    _refused(lm_cli.main, ["--method", "full", "--prepared", str(prepared), "--init-checkpoint", str(four),
                           "--out-dir", str(tmp_path / "o5")], capsys, f"--init-checkpoint {four}: {why4}")
    _refused(cls_cli.main, ["--method", "full", "--prepared", str(prepared), "--base", str(four),
                            "--out-dir", str(tmp_path / "o6")], capsys, f"--base {four}: {why4}")
    with_four = nlg[:i] + ["--init-checkpoint", str(four)] + nlg[i + 2 :]
    with_four.remove("--vocab-size"), with_four.remove(str(toy["vocab_size"]))
    _refused(nlg_cli.main, with_four, capsys, f"--init-checkpoint {four}: {why4}")
    assert not any((tmp_path / f"o{k}").exists() for k in range(5, 7))


def test_saved_configs_keep_qwen2_window_layers_and_label_names(tmp_path):
    """A full fine-tuning checkpoint's config.json means the base's model to transformers: Qwen2's
    window on the layers the base gives it (``max_window_layers``/``layer_types``; with no such
    layer there is no window, and ours refuses no length), DistilBERT's label names."""
    import json

    transformers = pytest.importorskip("transformers")
    from lora_core.models.distilbert import DistilBertConfig
    from lora_core.models.llama import LlamaConfig
    from lora_core.train.full_ft import hf_config

    d = dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    cfg = LlamaConfig.from_hf_dict(d)
    base = transformers.Qwen2Config(**{k: v for k, v in d.items() if k != "model_type"})
    saved = transformers.Qwen2Config(**{k: v for k, v in hf_config(cfg).items() if k not in ("architectures", "model_type")})
    assert cfg.sliding_window == 4 and list(saved.layer_types) == list(base.layer_types) == [
        "full_attention", "sliding_attention", "sliding_attention"]  # fmt: skip
    assert LlamaConfig.from_hf_dict(dict(d, max_window_layers=3)).sliding_window is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "distilbert", "id2label": {"0": "negative", "1": "positive"}}))
    dcfg = DistilBertConfig.from_hf_json(tmp_path / "config.json")
    assert dcfg.label_names == ("negative", "positive")
    assert hf_config(dcfg)["id2label"] == {0: "negative", 1: "positive"} and hf_config(dcfg)["label2id"]["positive"] == 1
    assert DistilBertConfig.from_hf_json(tmp_path / "config.json", num_labels=3).label_names is None  # a new head
