"""What a peft adapter means, kept as peft means it (or refused by name) in both backends: a tied
LM head that peft keeps on the base table, the padding token's embedding row that gets no
gradient, peft's sequence-classification ``modules_to_save`` pair, patterns matched with a
module prefix saved in our format, ``merge_lora`` on a weight two modules share."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import assert_close, tiny_hf_lm, to_numpy

import lora_core as lc
from lora_core.formats.tensor_files import CheckpointError
from lora_core.lora.targeting import LoRATargetConfig, TargetError
from lora_core.models.llama import LlamaConfig

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

V = 96


def _ids(seed=0, pad_at=None):
    ids = np.random.default_rng(seed).integers(1, V, (2, 7)).astype(np.int64)
    if pad_at is not None:
        ids[:, pad_at] = 0  # the padding id as an ordinary, attended token
    return ids


def _arr(backend, a):
    if backend.NAME == "torch":
        return torch.from_numpy(a)
    import jittor as jt

    return jt.array(a)


def _logits(backend, model, ids):
    out = model(_arr(backend, ids))
    return to_numpy(out[0] if isinstance(out, (tuple, list)) else out)


def _randomize(model, seed=1, std=0.3, also=()):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n or any(a in n for a in also):
                p.copy_(std * torch.randn(p.shape, generator=g))


def _llama(tmp_path, **kw):
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=V, **kw)  # fmt: skip
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    m.save_pretrained(tmp_path / "base")
    return m, tmp_path / "base"


def _gpt2(tmp_path):
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(cfg).eval()
    m.save_pretrained(tmp_path / "base")
    return m, tmp_path / "base"


def _peft_save(hf, folder, **lora_kw):
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=4, lora_alpha=8, **lora_kw)).eval()
    _randomize(pm, also=("modules_to_save",))
    pm.save_pretrained(folder)
    return pm


@pytest.mark.parametrize("lora_kw", [dict(target_modules=["wte", "c_attn"]),
                                     dict(target_modules=["c_attn"], modules_to_save=["wte"])],
                         ids=["wte-lora", "wte-saved"])  # fmt: skip
def test_gpt2_tied_head_adapters_peft_reads_otherwise_are_refused(backend, tmp_path, lora_kw):
    """peft keeps GPT-2's tied head on the base ``wte``; ours' head reads wte's LoRA update (and a
    trained wte): a peft folder that adapts or saves wte, or ours saved for peft, is refused."""
    hf, base = _gpt2(tmp_path)
    _peft_save(hf, tmp_path / "peft", **lora_kw)
    with pytest.raises(CheckpointError, match=r"adapter_config\.json: a peft adapter here would not give peft's logits: wte"):
        backend.from_pretrained(base, adapter=tmp_path / "peft")
    ours = backend.from_pretrained(base)
    backend.inject_lora(ours, LoRATargetConfig(r=2, alpha=4, **{k.replace("lora_", ""): tuple(v) for k, v in lora_kw.items()}))
    with pytest.raises(CheckpointError, match="wte"):
        backend.save_lora_adapter(ours, tmp_path / "out", format="peft")
    assert not (tmp_path / "out" / "adapter_config.json").exists()
    backend.save_lora_adapter(ours, tmp_path / "own")  # our format keeps our meaning
    assert backend.from_pretrained(base, adapter=tmp_path / "own").lora_injection.config == ours.lora_injection.config


def test_tied_llama_saved_embedding_is_refused_untied_loads(backend, tmp_path):
    """A tied Llama with ``modules_to_save=["embed_tokens"]``: peft's head reads the base table, a
    separate module from the trained copy; ours would read the trained one: refused. Untied, the
    same adapter loads with peft's logits."""
    hf, base = _llama(tmp_path / "tied", tie_word_embeddings=True)
    _peft_save(hf, tmp_path / "tied" / "peft", target_modules=["q_proj"], modules_to_save=["embed_tokens"])
    with pytest.raises(CheckpointError, match="model.embed_tokens is in modules_to_save"):
        backend.from_pretrained(base, adapter=tmp_path / "tied" / "peft")
    with pytest.raises(TargetError, match="LM head is tied to model.embed_tokens: it reads that table and has no lm_head"):
        backend.inject_lora(backend.from_pretrained(base), LoRATargetConfig(r=2, alpha=4, target_modules=("lm_head",)))
    hf, base = _llama(tmp_path / "untied", tie_word_embeddings=False)
    pm = _peft_save(hf, tmp_path / "untied" / "peft", target_modules=["q_proj"], modules_to_save=["embed_tokens"])
    ours = backend.from_pretrained(base, adapter=tmp_path / "untied" / "peft")
    ours.eval()
    ids = _ids()
    ref = to_numpy(pm(torch.from_numpy(ids)).logits.detach())
    assert np.abs(ref - to_numpy(hf(torch.from_numpy(ids)).logits.detach())).max() > 1e-2  # the adapter matters
    assert_close(f"{backend.NAME} untied saved embedding vs peft", _logits(backend, ours, ids), ref, 1e-5, floor=1.0)


def test_merge_refuses_a_lora_layer_whose_weight_another_module_shares():
    """transformers' tied Llama: ``lm_head.weight is embed_tokens.weight``; merging the head's LoRA
    would change the input embedding too."""
    bt = lc.get_backend("torch")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=V, tie_word_embeddings=True)  # fmt: skip
    m = transformers.LlamaForCausalLM(cfg).eval()
    assert m.lm_head.weight is m.model.embed_tokens.weight
    bt.inject_lora(m, LoRATargetConfig(r=2, alpha=4, target_modules=("lm_head", "q_proj")))
    _randomize(m)
    before = m.model.embed_tokens.weight.detach().clone()
    with pytest.raises(ValueError, match=r"lm_head \(LoRA\) shares its weight with model.embed_tokens"):
        bt.merge_lora(m)
    assert torch.equal(m.model.embed_tokens.weight, before) and not m.lm_head.merged


def test_seq_cls_adapter_with_peft_head_pair_loads(backend, tmp_path):
    """peft's SEQ_CLS adapters list both ``classifier`` and ``score``; DistilBERT has the first:
    the folder loads with peft's logits. A lone entry that matches nothing is still refused,
    naming the adapter's config file."""
    cfg = transformers.DistilBertConfig(vocab_size=V, dim=32, hidden_dim=64, n_layers=2, n_heads=4,
                                        max_position_embeddings=32, num_labels=2)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.DistilBertForSequenceClassification(cfg).eval()
    hf.save_pretrained(tmp_path / "base")
    pm = _peft_save(hf, tmp_path / "peft", target_modules=["q_lin", "v_lin"], task_type="SEQ_CLS")
    assert set(pm.peft_config["default"].modules_to_save) >= {"classifier", "score"}
    ours = backend.distilbert_from_pretrained(tmp_path / "base", adapter=tmp_path / "peft")
    ours.eval()
    ids = _ids()
    ref = to_numpy(pm(input_ids=torch.from_numpy(ids)).logits.detach())
    assert_close(f"{backend.NAME} SEQ_CLS adapter vs peft", _logits(backend, ours, ids), ref, 1e-5, floor=1.0)
    _peft_save(hf, tmp_path / "typo", target_modules=["q_lin"], modules_to_save=["classifer"])
    with pytest.raises(TargetError, match=r"typo/adapter_config\.json: .*modules_to_save 'classifer'"):
        backend.distilbert_from_pretrained(tmp_path / "base", adapter=tmp_path / "typo")


@pytest.mark.parametrize("lora_kw", [dict(target_modules=r"transformer\.h\.1\.attn\.c_attn"),
                                     dict(target_modules=["c_attn"], rank_pattern={"transformer.h.0.attn.c_attn": 2}),
                                     dict(target_modules=["c_attn"], modules_to_save=["transformer.ln_f"])],
                         ids=["regex", "rank-pattern", "saved-module"])  # fmt: skip
def test_prefixed_peft_patterns_survive_our_format(backend, tmp_path, lora_kw):
    """Patterns naming transformers' full paths (``transformer.h.1...``) load into our GPT-2 (our
    names lack the prefix); saved again in our format (the train commands' checkpoints) they
    load again, and in peft's format peft reads them: the same logits each way."""
    hf, base = _gpt2(tmp_path)
    pm = _peft_save(hf, tmp_path / "peft", **lora_kw)
    ids = _ids()
    ref = to_numpy(pm(torch.from_numpy(ids)).logits.detach())
    ours = backend.from_pretrained(base, adapter=tmp_path / "peft")
    ours.eval()
    assert_close("peft -> ours", _logits(backend, ours, ids), ref, 1e-5, floor=1.0)
    backend.save_lora_adapter(ours, tmp_path / "own")
    again = backend.from_pretrained(base, adapter=tmp_path / "own")
    again.eval()
    assert_close("ours -> our format -> ours", _logits(backend, again, ids), ref, 1e-5, floor=1.0)
    backend.save_lora_adapter(again, tmp_path / "back", format="peft")
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "back").eval()
    assert_close("ours -> peft format -> peft", to_numpy(theirs(torch.from_numpy(ids)).logits.detach()), ref, 1e-5,
                 floor=1.0)  # fmt: skip


@pytest.mark.parametrize("lora_kw", [dict(target_modules=("c_attn",), alpha_pattern={r"^h\.1\.attn\.c_attn": 32.0}),
                                     dict(target_modules=("c_attn",), rank_pattern={r"^h\.0\.attn\.c_attn": 2}),
                                     dict(target_modules=r"^h\.1\.(attn\.c_attn|mlp\.c_(fc|proj))",
                                          rank_pattern={r"\Ah\.1\.mlp\.c_fc": 2}),
                                     dict(target_modules=("c_attn", "c_fc"), rank_pattern={r"^h\.0\..*": 3},
                                          fused_slices={r"^h\.1\.attn\.c_attn": (True, False, True)})],
                         ids=["anchored-alpha", "anchored-rank", "anchored-regex-target", "anchored-and-sliced"])  # fmt: skip
def test_our_anchored_patterns_mean_the_same_in_peft(tmp_path, lora_kw):
    """Our GPT-2's patterns name ``h.1.attn.c_attn``, peft's model ``transformer.h.1.attn.c_attn``:
    an anchored pattern, saved in peft's format, adapts in peft the same modules with the same r
    and scaling (every module of the loaded PeftModel compared), and peft's logits are ours."""
    bt = lc.get_backend("torch")
    torch.manual_seed(0)
    hf = tiny_hf_lm("gpt2").eval()
    hf.save_pretrained(tmp_path / "base")
    ours = bt.from_pretrained(tmp_path / "base")
    bt.inject_lora(ours, LoRATargetConfig(r=4, alpha=8.0, **lora_kw))
    _randomize(ours)
    ids = _ids()
    want = _logits(bt, ours, ids)
    bt.save_lora_adapter(ours, tmp_path / "peft", format="peft")
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "peft").eval()
    inner, adapted = theirs.base_model.model.transformer, 0
    for name, mod in ours.named_modules():
        if not name or "lora_" in name:  # (our LoRA layers' own dropout modules)
            continue
        peft_mod = inner.get_submodule(name)
        lora_a = getattr(mod, "lora_A", None)
        is_lora = isinstance(peft_mod, peft.tuners.lora.LoraLayer)
        assert is_lora == isinstance(lora_a, torch.nn.Parameter), name
        if is_lora:
            adapted += 1
            assert peft_mod.r["default"] == lora_a.shape[0], name
            assert peft_mod.scaling["default"] == pytest.approx(mod.scaling, rel=1e-12), name
    assert adapted == sum(n.endswith(".lora_A") for n in bt.trainable_parameters(ours))
    got = to_numpy(theirs(torch.from_numpy(ids)).logits.detach())
    assert_close("ours (anchored patterns) -> peft format -> peft", got, want, 1e-5)


def _grads(backend, model, ids):
    logits = model(_arr(backend, ids))
    logits = logits[0] if isinstance(logits, (tuple, list)) else logits
    w = _arr(backend, np.random.default_rng(5).normal(size=tuple(logits.shape)).astype(np.float32))
    loss = (logits * w).sum()
    params = backend.trainable_parameters(model)
    if backend.NAME == "torch":
        loss.backward()
        return {n: to_numpy(p.grad) for n, p in params.items()}
    import jittor as jt

    return {n: to_numpy(g) for n, g in zip(params, jt.grad(loss, list(params.values())))}


@pytest.mark.parametrize("lora_kw", [dict(target_modules=["embed_tokens", "q_proj"]),
                                     dict(target_modules=["q_proj"], modules_to_save=["embed_tokens"])],
                         ids=["embedding-lora", "embedding-saved"])  # fmt: skip
def test_padding_row_gets_no_gradient_as_in_peft(backend, tmp_path, lora_kw):
    """transformers builds ``embed_tokens`` with ``padding_idx=pad_token_id``: the pad id's row of
    the table (and of a LoRA embedding's A) gets no gradient where the id is an ordinary token.
    Ours, both backends: peft's gradients, that row zero included."""
    hf, base = _llama(tmp_path, pad_token_id=0)
    pm = _peft_save(hf, tmp_path / "peft", **lora_kw)
    ids = _ids(pad_at=3)
    logits = pm(torch.from_numpy(ids)).logits
    w = torch.from_numpy(np.random.default_rng(5).normal(size=tuple(logits.shape)).astype(np.float32))
    (logits * w).sum().backward()
    theirs = {n: p.grad.numpy() for n, p in pm.named_parameters() if p.requires_grad}
    ours = backend.from_pretrained(base, adapter=tmp_path / "peft")
    ours.eval()
    got = _grads(backend, ours, ids)
    if "modules_to_save" in lora_kw:
        g, ref = got["model.embed_tokens.weight"], theirs["base_model.model.model.embed_tokens.modules_to_save.default.weight"]
    else:
        g, ref = got["model.embed_tokens.lora_A"], theirs["base_model.model.model.embed_tokens.lora_embedding_A.default"].T
        g = g.T
    assert np.abs(ref).max() > 0 and not ref[0].any()
    assert not g[0].any(), f"{backend.NAME}: the padding row got a gradient"
    assert_close(f"{backend.NAME} embedding gradient vs peft", g, ref, 1e-5, floor=1e-3)


def test_pad_token_id_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="pad_token_id must be None or a token id of the 96-token vocabulary"):
        LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, pad_token_id=96)  # fmt: skip
    assert LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, pad_token_id=-1).padding_idx == 95  # fmt: skip


def test_loaded_model_is_in_evaluation_mode(backend, tmp_path):
    """``from_pretrained`` returns the model in evaluation mode, as transformers' does: an adapter
    with dropout gives peft's (eval) logits at once, the same on every call; a training step
    switches to training mode itself."""
    hf, base = _llama(tmp_path)
    pm = _peft_save(hf, tmp_path / "peft", target_modules=["q_proj", "v_proj"], lora_dropout=0.5)
    ours = backend.from_pretrained(base, adapter=tmp_path / "peft")
    ids = _ids()
    first, second = _logits(backend, ours, ids), _logits(backend, ours, ids)
    assert np.array_equal(first, second)
    assert_close(f"{backend.NAME} loaded (eval mode) vs peft", first, to_numpy(pm(torch.from_numpy(ids)).logits.detach()),
                 1e-5, floor=1.0)  # fmt: skip


def _bert(num_labels=2):
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=48, max_position_embeddings=32, num_labels=num_labels)  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg).eval()


def test_any_model_embeddings_as_peft_or_refused_by_name():
    """torch ``inject_lora`` on any model: an Embedding subclass (its own forward) and one with
    ``max_norm`` are refused by name; ``scale_grad_by_freq`` is kept (peft's gradients); LoRA on a
    BERT embedding merges (no tied head: the logits unchanged)."""
    bt = lc.get_backend("torch")
    nn = torch.nn

    class Scaled(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2.0

    for first, words in ((Scaled(V, 8), r"\['0 \(Scaled\)'\]"), (nn.Embedding(V, 8, max_norm=1.0), "Embedding with max_norm")):
        model = nn.Sequential(first, nn.Linear(8, 4))
        with pytest.raises(TargetError, match=words):
            bt.inject_lora(model, LoRATargetConfig(r=2, alpha=4, target_modules=("0",)))
        assert type(model[0]) is type(first) and not hasattr(model, "lora_injection")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, 8, scale_grad_by_freq=True), nn.Linear(8, 4))
    theirs = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["0"],
                                                                         init_lora_weights=False))  # fmt: skip
    bt.inject_lora(model, LoRATargetConfig(r=2, alpha=4, target_modules=("0",)))
    with torch.no_grad():
        model[0].lora_A.copy_(theirs.base_model.model[0].lora_embedding_A["default"])
        model[0].lora_B.copy_(theirs.base_model.model[0].lora_embedding_B["default"])
    ids = torch.tensor([[3, 3, 3, 3, 5, 7]])
    model(ids).sum().backward()
    theirs(ids).sum().backward()
    assert_close("scale_grad_by_freq: lora_A grad vs peft", to_numpy(model[0].lora_A.grad),
                 to_numpy(theirs.base_model.model[0].lora_embedding_A["default"].grad), 1e-6)  # fmt: skip
    bert = _bert()
    bt.inject_lora(bert, LoRATargetConfig(r=2, alpha=4, target_modules=("word_embeddings", "query")))
    _randomize(bert)
    ids = torch.from_numpy(_ids())
    before = bert(input_ids=ids).logits.detach()
    bt.merge_lora(bert)
    assert_close("BERT embedding LoRA merged vs unmerged", bert(input_ids=ids).logits.detach(), before, 1e-5, floor=1.0)


def test_a_failed_injection_leaves_the_model_as_it_was():
    """A 4-bit layer in ``modules_to_save`` is refused before any module is replaced."""
    from backends.torch.quant import LoRALinear4bit
    from lora_core.quant.nf4 import quantize_nf4

    bt = lc.get_backend("torch")
    nn = torch.nn
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)
    q = LoRALinear4bit(quantize_nf4(lin.weight.detach().numpy()), nn.Parameter(lin.bias.detach().clone()))
    model = nn.Sequential(q, nn.ReLU(), nn.Linear(64, 8))
    with pytest.raises(TargetError, match=r"matches 4-bit layer\(s\) \['0'\]"):
        bt.inject_lora(model, LoRATargetConfig(r=2, alpha=4, target_modules=("2",), modules_to_save=("0",)))
    assert type(model[2]) is nn.Linear and not hasattr(model, "lora_injection")
    assert bt.inject_lora(model, LoRATargetConfig(r=2, alpha=4, target_modules=("2",))) == ["2"]


def test_peft_folders_of_the_same_meaning_load(tmp_path):
    """A peft SEQ_CLS adapter with ``bias="all"`` (peft also writes its wrapper's copies of the
    head's bias) loads with peft's logits; a model reloads its own peft save although peft wrote
    its targets in another order and no seed."""
    bt = lc.get_backend("torch")
    base = _bert()
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["query", "value"], bias="all",
        init_lora_weights=False)).eval()  # fmt: skip
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            if p.requires_grad and "lora_" not in n:
                p.add_(0.1)
    theirs.save_pretrained(tmp_path / "peft")
    ours = copy.deepcopy(base)
    bt.load_lora_adapter(ours, tmp_path / "peft")
    ids = torch.from_numpy(_ids())
    assert_close("bias=all SEQ_CLS adapter vs peft", ours(input_ids=ids).logits.detach(),
                 theirs(input_ids=ids).logits.detach(), 1e-5, floor=1.0)  # fmt: skip
    m = copy.deepcopy(base)
    bt.inject_lora(m, LoRATargetConfig(r=4, alpha=8, target_modules=("value", "query"), seed=3))
    _randomize(m)
    bt.save_lora_adapter(m, tmp_path / "own", format="peft")
    assert bt.load_lora_adapter(m, tmp_path / "own") == ["bert.encoder.layer.0.attention.self.query",
                                                         "bert.encoder.layer.0.attention.self.value"]  # fmt: skip


def test_embedding_gradient_rules_jittor_equal_torch():
    """``LoRAEmbedding`` with ``padding_idx`` and ``scale_grad_by_freq`` (torch's ``F.embedding``
    rules, peft's): jittor's gradients of the table and of A equal torch's."""
    bj, bt = lc.get_backend("jittor"), lc.get_backend("torch")
    import jittor as jt

    from backends.jittor.lora import LoRAEmbedding as JEmbedding
    from backends.torch.lora import LoRAEmbedding as TEmbedding

    rng = np.random.default_rng(0)
    W, A, B = (rng.normal(size=s).astype(np.float32) for s in ((10, 4), (2, 10), (4, 2)))
    ids, g = np.array([[3, 3, 3, 0, 5, 0]]), rng.normal(size=(1, 6, 4)).astype(np.float32)
    t = TEmbedding(10, 4, 2, 4.0, padding_idx=0, scale_grad_by_freq=True)
    with torch.no_grad():
        for p, v in ((t.weight, W), (t.lora_A, A), (t.lora_B, B)):
            p.copy_(torch.from_numpy(v))
    (t(torch.from_numpy(ids)) * torch.from_numpy(g)).sum().backward()
    j = JEmbedding(10, 4, 2, 4.0, padding_idx=0, scale_grad_by_freq=True)
    for p, v in ((j.weight, W), (j.lora_A, A), (j.lora_B, B)):
        p.assign(jt.array(v))
    gw, ga = jt.grad((j(jt.array(ids)) * jt.array(g)).sum(), [j.weight, j.lora_A])
    assert not t.weight.grad[0].any() and t.weight.grad[3].abs().max() > 0
    assert_close("jittor embedding grad (padding, by frequency)", gw.numpy(), t.weight.grad, 1e-6)
    assert_close("jittor lora_A grad (padding, by frequency)", ga.numpy(), t.lora_A.grad, 1e-6)
    assert bj.NAME == "jittor" and bt.NAME == "torch"
