"""Decoding fast paths, both backends: ``model.decoding()`` (LoRA merged into copies of the
weights, pre-packed for oneDNN in torch, transposed in jittor) and ``KVCache`` (beam reorder
applied lazily inside the next forward) give the plain forward's logits (1e-5 x scale)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, to_numpy

import lora_core as lc

TOL = 1e-5


def _model(backend):
    cfg = lc.gpt2_config("tiny", n_layer=2)
    m = backend.build_model(cfg, lc.LoRAConfig(r=4, alpha=32), lc.init_gpt2_weights(cfg, 0), trainable=False)
    rng = np.random.default_rng(1)  # non-zero B: the merged weights differ from the base
    m.load_partial({n: rng.normal(0, 0.05, v.shape).astype(np.float32)
                    for n, v in m.state_numpy().items() if "lora_" in n})
    m.eval()
    return cfg, m


def _batch(cfg):
    rng = np.random.default_rng(2)
    ids = rng.integers(0, cfg.vocab_size, (3, 7)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, :3] = mask[2, :5] = 0  # left padding
    return ids, mask


def test_decoding_weights_give_plain_logits_and_leave_the_model_untouched(backend):
    cfg, m = _model(backend)
    ids, mask = _batch(cfg)
    before = m.state_numpy()
    plain = to_numpy(m(ids, attention_mask=mask)[0])
    with m.decoding(rows=3):
        assert m.decode_head is not None and m.h[0].attn.c_attn.decode_weight is not None  # the fast path is on
        fast = to_numpy(m(ids, attention_mask=mask)[0])
    assert m.decode_head is None and m.h[0].attn.c_attn.decode_weight is None
    real = mask.astype(bool)
    assert_close(f"decoding() vs plain logits ({backend.NAME})", fast[real], plain[real], TOL, floor=1.0)
    after = m.state_numpy()
    assert all(np.array_equal(before[n], after[n]) for n in before)
    assert np.array_equal(to_numpy(m(ids, attention_mask=mask)[0]), plain)  # plain path restored


@pytest.mark.parametrize("k", [1, 2])
def test_kv_cache_with_lazy_reorder_matches_list_cache(backend, k):
    """``KVCache`` over 20 steps (its buffers grown past their first room) against the list
    cache: ``k`` beams per input, reordered lazily (two reorders composed once); one beam:
    the prompt and the generated positions in one buffer."""
    cfg, m = _model(backend)
    ids, mask = _batch(cfg)
    _, past = m(ids, attention_mask=mask)
    cache = backend.KVCache(past, k)
    ref = [(np.repeat(to_numpy(a), k, 0), np.repeat(to_numpy(b), k, 0)) for a, b in past]
    rng = np.random.default_rng(3)
    mask = np.repeat(mask, k, 0)
    for step in range(20):
        rows = np.concatenate([b * k + rng.integers(0, k, k) for b in range(len(ids))])
        cache.reorder(rows)
        if step == 1:  # two reorders before one forward compose
            again = np.concatenate([b * k + rng.integers(0, k, k) for b in range(len(ids))])
            cache.reorder(again)
            rows = rows[again]
        ref = [(a[rows], b[rows]) for a, b in ref]
        mask = np.concatenate([mask[rows], np.ones((len(rows), 1), dtype=mask.dtype)], 1)
        tok = rng.integers(0, cfg.vocab_size, (len(rows), 1)).astype(np.int64)
        want, ref = m(tok, past=[tuple(_like(backend, t) for t in kv) for kv in ref], attention_mask=mask)
        got, cache = m(tok, past=cache, attention_mask=mask)
        assert isinstance(cache, backend.KVCache) and cache.length == ids.shape[1] + step + 1
        assert_close(f"KVCache vs list cache logits ({backend.NAME})", got, want, TOL, floor=1.0)
        ref = [(to_numpy(a), to_numpy(b)) for a, b in ref]


def _like(backend, x):
    if backend.NAME == "torch":
        import torch

        return torch.from_numpy(np.asarray(x, dtype=np.float32))
    import jittor as jt

    return jt.array(np.asarray(x, dtype=np.float32))


def test_kv_cache_refuses_a_reorder_across_inputs(backend):
    import pytest

    cfg, m = _model(backend)
    ids, mask = _batch(cfg)
    cache = backend.KVCache(m(ids, attention_mask=mask)[1], 2)
    with pytest.raises(ValueError, match="its own input"):
        cache.reorder(np.array([0, 2, 2, 3, 4, 5]))  # row 1 (input 0) would continue row 2 (input 1)


def test_decoding_products_for_few_and_many_rows(backend):
    """``pack_weight`` + ``linear_decode`` in both backends, for the few rows of greedy decoding
    (a rows hint of 2: torch's plain weight, run as W x^T at 2-3 rows (``FEW_ROWS``); jittor's
    (out, in) weight as x W^T) and the many of beam search (80: oneDNN's packed weight, jittor's
    (in, out) copy): x W^T + b for 1 to 5 and 64 input rows (the prompt's), 1e-6 x scale; in
    torch with and without the fused GELU too, and the output row-major (a transposed one
    makes the next product's input the layout MKL runs at a third of the speed)."""
    import importlib

    lora = importlib.import_module(f"backends.{backend.NAME}.lora")
    rng = np.random.default_rng(4)
    w_np = rng.normal(0, 0.05, (48, 40)).astype(np.float32)
    b_np = rng.normal(0, 0.05, 48).astype(np.float32)
    torch_ = backend.NAME == "torch"
    if torch_:
        import torch as fw
        import torch.nn.functional as F

        make, gelus = fw.from_numpy, (False, True)
        assert lora.FEW_ROWS == (2, 3)
    else:
        import jittor as fw

        make, gelus = fw.array, (False,)
    layouts = {2: ("plain",) if torch_ else ("out_in",), 80: ("plain", "onednn") if torch_ else ("in_out",)}
    for hint in (2, 80):
        packed = lora.pack_weight(make(w_np), hint)
        assert packed[0] in layouts[hint], (hint, packed[0])
        for rows in (1, 2, 3, 4, 5, 64):
            x = rng.normal(size=(rows, 1, 40)).astype(np.float32)
            for bias in (None, b_np):
                for gelu in gelus:
                    args = (make(x), packed, None if bias is None else make(bias)) + ((gelu,) if torch_ else ())
                    y = lora.linear_decode(*args)
                    ref = x @ w_np.T + (0 if bias is None else bias)
                    if gelu:
                        ref = F.gelu(fw.from_numpy(ref), approximate="tanh").numpy()
                    if torch_:
                        assert tuple(y.shape) == ref.shape and y.is_contiguous(), (hint, rows, y.stride())
                    assert_close(f"decoding product ({backend.NAME}, rows hint {hint}, {rows} rows)", y, ref, 1e-6)


def test_torch_few_rows_product_over_column_blocks(monkeypatch):
    """torch, a rows hint of 2-3 and more input features than ``DECODE_K_BLOCK``: the weight is
    kept with a copy in contiguous column blocks, equal and the fewest of at most that width
    (MKL read such weights at 10-13 GB/s as one W x^T, 17-19 GB/s block by block), and the
    product over the blocks is x W^T + b (1e-6 x scale) at 2 and 3 rows; other row counts use
    the weight itself."""
    import torch

    from backends.torch import lora

    assert lora.pack_weight(torch.zeros(8, 1024), 2)[0] == "plain"
    kind, (w, blocks) = lora.pack_weight(torch.zeros(8, 2816), 2)
    assert kind == "blocks" and [b.shape[1] for b in blocks] == [939, 939, 938]
    assert lora.pack_weight(torch.zeros(8, 2816), 4)[0] != "blocks"
    monkeypatch.setattr(lora, "DECODE_K_BLOCK", 16)
    rng = np.random.default_rng(5)
    w_np = rng.normal(0, 0.05, (48, 40)).astype(np.float32)
    b_np = rng.normal(0, 0.05, 48).astype(np.float32)
    kind, (w, blocks) = lora.pack_weight(torch.from_numpy(w_np), 3)
    assert kind == "blocks" and [b.shape[1] for b in blocks] == [14, 14, 12] and all(b.is_contiguous() for b in blocks)
    assert np.array_equal(torch.cat(blocks, 1).numpy(), w_np)
    for rows in (1, 2, 3, 4, 64):
        x = rng.normal(size=(rows, 1, 40)).astype(np.float32)
        for bias in (None, b_np):
            for gelu in (False, True):
                y = lora.linear_decode(torch.from_numpy(x), (kind, (w, blocks)), None if bias is None else torch.from_numpy(bias), gelu)
                ref = x @ w_np.T + (0 if bias is None else bias)
                if gelu:
                    ref = torch.nn.functional.gelu(torch.from_numpy(ref), approximate="tanh").numpy()
                assert tuple(y.shape) == ref.shape and y.is_contiguous()
                assert_close(f"decoding product over column blocks ({rows} rows)", y, ref, 1e-6)
