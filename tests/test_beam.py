"""Beam search: numpy bookkeeping (paper semantics) and both backends' batched search."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from helpers import MEASURED, rel_diff

import lora_core as lc
from lora_core.generate.beam import BeamConfig, BeamSearch, banned_ngram_tokens, postprocess


def test_banned_ngrams_fairseq():
    h = np.array([[1, 2, 3, 1, 2], [4, 4, 4, 4, 4]])
    assert banned_ngram_tokens(h, 3) == [[3], [4, 4, 4]]
    assert banned_ngram_tokens(h[:, :1], 3) == [[], []]


def test_repetition_penalty_ctrl_and_min_length():
    cfg = BeamConfig(beam=1, repetition_penalty=2.0, min_length=2, stop_ids=(0,), no_repeat_ngram_size=0)
    out = postprocess(np.array([[1.0, -1.0, 4.0, 3.0]]), np.array([[1, 2, 2]]), cur_len=1, cfg=cfg)
    assert out.tolist() == [[-np.inf, -2.0, 2.0, 3.0]]


def _search(logit_rows, cfg, B=1):
    s = BeamSearch(B, cfg)
    for lg in logit_rows:
        if s.done:
            break
        s.step(np.asarray(lg, dtype=np.float64))
    return s


def test_length_penalty_counts_generated_tokens_including_eos():
    """Two candidates: eos at once (len 1, logp a) vs one token then eos (len 2)."""
    eos = 3
    lp = np.log
    step0 = np.log(np.array([[0.05, 0.6, 0.05, 0.3]] * 2))  # beam rows identical
    step1 = np.log(np.array([[0.2, 0.2, 0.2, 0.4]] * 2))
    for alpha, want in ((0.0, [3]), (1.0, [1, 3])):
        cfg = BeamConfig(beam=2, max_new_tokens=2, length_penalty=alpha, stop_ids=(eos,), no_repeat_ngram_size=0)
        s = _search([step0, step1], cfg)
        assert s.results() == [want], (alpha, s.results())
        score = lp(0.3) if want == [3] else (lp(0.6) + lp(0.4)) / 2 ** alpha
        assert np.isclose(s.best_score[0], score)


def test_all_finished_stops_early():
    cfg = BeamConfig(beam=2, max_new_tokens=50, stop_ids=(0, 1), no_repeat_ngram_size=0)
    s = _search([np.log(np.array([[0.5, 0.49, 0.01]] * 2))] * 3, cfg)
    assert s.done and s.step_index == 1 and s.results() == [[0]]


@pytest.fixture(scope="module")
def tiny():
    cfg = lc.gpt2_config("tiny")
    return cfg, lc.init_gpt2_weights(cfg, 0)


def test_batched_equals_single_and_backends_agree(backend, tiny):
    cfg, base = tiny
    other = lc.get_backend("jittor" if backend.NAME == "torch" else "torch")
    ctxs = [list(np.random.default_rng(i).integers(1, 999, 2 + 2 * i)) for i in range(5)]
    bc = BeamConfig(beam=4, max_new_tokens=10, stop_ids=(5, 7, 9), length_penalty=0.8, repetition_penalty=1.2)
    m = backend.build_model(cfg, None, base)
    batched = backend.beam_search(m, ctxs, bc, batch_size=3)
    assert batched == [backend.beam_search(m, [c], bc)[0] for c in ctxs]
    assert all(0 < len(r) <= 10 for r in batched)
    assert batched == other.beam_search(other.build_model(cfg, None, base), ctxs, bc, batch_size=5)


@pytest.mark.parametrize("n", [50257, 512, 30, 1031])
def test_row_topk_exact_with_ties(n):
    """The blocked top-k equals a full sort (value descending, index ascending), ties included."""
    from lora_core.generate.beam import row_topk

    rng = np.random.default_rng(n)

    def full_sort(x, k):
        return np.array([np.lexsort((np.arange(x.shape[1]), -row))[:k] for row in x])

    x = rng.normal(size=(12, n)).astype(np.float32)
    x[3, 10:20] = 10
    x[3, 5] = 10
    tied = np.full((3, n), -np.inf, np.float32)
    tied[:, n - 7:] = 1
    tied[1, 7] = 1
    for a in (x, np.round(x, 1), tied):
        assert (row_topk(a, 10) == full_sort(a, 10)).all()


def test_device_scoring_gives_the_host_scoring_beams(backend, tiny):
    """Scoring on the device (post-processing, log-sum-exp and top-k in the framework, only
    candidates to numpy) decodes exactly what host scoring decodes, with every edit in play."""
    cfg, base = tiny
    m = backend.build_model(cfg, None, base)
    ctxs = [list(np.random.default_rng(10 + i).integers(1, 999, 3 + i)) for i in range(5)]
    bc = BeamConfig(beam=4, max_new_tokens=12, stop_ids=(5, 7, 9), length_penalty=0.8, repetition_penalty=1.3,
                    min_length=4, no_repeat_ngram_size=2)
    host = backend.beam_search(m, ctxs, bc, batch_size=3, scoring="host")
    assert backend.beam_search(m, ctxs, bc, batch_size=3, scoring="device") == host
    assert all(len(r) >= 4 for r in host)  # min_length held
    with pytest.raises(ValueError, match="unknown scoring 'gpu'.*auto, host, device"):
        backend.beam_search(m, ctxs, bc, scoring="gpu")


def captured_search(model, ctxs, bc, batch_size, recorder=None):
    """torch's beam search with the captured decode step, and its ``StaticDecoder`` (shapes met)."""
    from backends.torch._captured_decode import StaticDecoder
    from backends.torch.generate import _forward, _reorder, _repeat_rows
    from lora_core.generate.beam import beam_search_batched

    static = StaticDecoder(model, bc.max_new_tokens, recorder)
    on_device = next(model.parameters()).device.type != "cpu"
    model.eval()
    with model.decoding(rows=batch_size * bc.beam):
        out = beam_search_batched(_forward(model, on_device, static), _repeat_rows(static), _reorder, ctxs, bc,
                                  batch_size)
    return out, static


def test_captured_decode_step_gives_the_eager_beams(backend, tiny):
    """torch: the decode step on the preallocated cache (reordered in place, prompt slots padded
    to 32, the step of fixed shapes that a GPU captures) decodes exactly what the growing cache
    decodes, with every edit in play, under either scoring and in bf16; batches of one shape
    share its buffers, and the growing cache's n_positions bound holds. jittor (no capture)
    refuses "captured", naming what it supports."""
    cfg, base = tiny
    m = backend.build_model(cfg, lc.LoRAConfig(r=4, alpha=8), base)
    rng = np.random.default_rng(3)
    m.load_partial({n: rng.normal(0, 0.1, v.shape).astype(np.float32) for n, v in m.state_numpy().items()
                    if "lora_" in n})
    ctxs = [list(np.random.default_rng(10 + i).integers(1, 999, 3 + 2 * i)) for i in range(7)]
    bc = BeamConfig(beam=4, max_new_tokens=14, stop_ids=(5, 7, 9), length_penalty=0.8, repetition_penalty=1.3,
                    min_length=4, no_repeat_ngram_size=2)
    eager = backend.beam_search(m, ctxs, bc, batch_size=3, decode_step="eager")
    assert backend.beam_search(m, ctxs, bc, batch_size=3) == eager  # "auto" on the CPU
    with pytest.raises(ValueError, match="unknown decode_step 'graph'.*auto, eager, captured"):
        backend.beam_search(m, ctxs, bc, decode_step="graph")
    if backend.NAME == "jittor":
        with pytest.raises(ValueError, match="'captured' is not supported by the jittor backend"):
            backend.beam_search(m, ctxs, bc, decode_step="captured")
        return
    for scoring in ("host", "device"):
        assert backend.beam_search(m, ctxs, bc, batch_size=3, scoring=scoring, decode_step="captured") == eager
    out, static = captured_search(m, ctxs, bc, 3)  # prompts of 7, 13 and 15 positions: 32 slots each
    assert out == eager and sorted(static.caches) == [(4, 32), (12, 32)]
    backend.set_precision(m, "bf16")
    try:
        assert backend.beam_search(m, ctxs, bc, batch_size=3, decode_step="captured") == \
            backend.beam_search(m, ctxs, bc, batch_size=3, decode_step="eager")
    finally:
        backend.set_precision(m, "fp32")
    long = [list(range(1, cfg.n_positions - 5)), [3, 4]]
    for step in ("eager", "captured"):
        with pytest.raises(ValueError, match=f"sequence of {cfg.n_positions + 1} tokens exceeds n_positions"):
            backend.beam_search(m, long, BeamConfig(beam=2, max_new_tokens=10, stop_ids=()), decode_step=step)


class ReplayRecorder:
    """A CPU stand-in for ``CUDAGraphRecorder`` with its contract: two warm-up runs, an ``out``
    fixed at recording, each replay recomputing the step into that ``out`` (unlike a CUDA
    graph, the recording executes the step too); it asserts that it is handed ``device``,
    the model's device (the one a CUDA graph must be recorded on)."""

    def __init__(self, device="cpu"):
        self.replays, self.device, self.devices = 0, device, []

    def record(self, fn, device):
        import torch

        self.devices.append(device)
        assert device == torch.device(self.device), f"recorder handed {device}, the model is on {self.device}"
        for _ in range(2):
            fn()
        out = fn()

        def replay():
            self.replays += 1
            out.copy_(fn())

        return replay, out


def test_captured_step_record_and_replay_logic(tiny):
    """The GPU branch of the captured step, driven on CPU by a recorder of the CUDA graph
    contract: one recording per shape, at a batch's first step (where the warm-ups' runs change
    nothing), each step one replay into the reused output tensor, and the eager beams."""
    cfg, base = tiny
    bt = lc.get_backend("torch")
    m = bt.build_model(cfg, None, base)
    ctxs = [list(np.random.default_rng(20 + i).integers(1, 999, 3 + 2 * i)) for i in range(7)]
    bc = BeamConfig(beam=4, max_new_tokens=12, stop_ids=(), length_penalty=0.8, repetition_penalty=1.3,
                    no_repeat_ngram_size=2)
    eager = bt.beam_search(m, ctxs, bc, batch_size=3, decode_step="eager")
    rec = ReplayRecorder(next(m.parameters()).device)
    out, static = captured_search(m, ctxs, bc, 3, rec)
    assert out == eager and len(rec.devices) == 2  # one recording per shape, each handed the model's device
    assert static.captures == len(static.graphs) == len(static.caches) == 2  # (12, 32) and (4, 32)
    assert rec.replays == 3 * (bc.max_new_tokens - 1)  # every step of the 3 batches (no stop ids: all 12 tokens)
    cache = next(iter(static.caches.values()))
    cache.s = 1
    with pytest.raises(RuntimeError, match="first met at step 1, not 0"):
        static._capture(cache)


def test_captured_step_logits_match_a_full_forward(tiny):
    """The step on the preallocated cache, with beams reordered in place between steps, gives
    the logits of a full forward pass over each row's whole (left-padded) sequence."""
    import torch

    from backends.torch._captured_decode import StaticDecoder
    from lora_core.generate.beam import left_pad

    cfg, base = tiny
    bt = lc.get_backend("torch")
    m = bt.build_model(cfg, None, base).eval()
    rng = np.random.default_rng(4)
    ids, mask = left_pad([rng.integers(1, 999, 5).tolist(), rng.integers(1, 999, 9).tolist()])
    static = StaticDecoder(m, 8)
    with torch.no_grad():
        past = m(ids, attention_mask=mask)[1]
        cache = static.start(past, 2, mask)
        seq, msk, worst = np.repeat(ids, 2, 0), np.repeat(mask, 2, 0), 0.0
        for rows in ([0, 1, 2, 3], [1, 1, 2, 2], [0, 1, 3, 2], [1, 0, 3, 3], [0, 0, 2, 3]):
            cache.reorder(np.array(rows))
            tok = rng.integers(1, 999, 4)
            out = static.step(cache, tok).numpy()
            seq = np.concatenate([seq[rows], tok[:, None]], 1)
            msk = np.concatenate([msk[rows], np.ones((4, 1), msk.dtype)], 1)
            ref = m(seq, attention_mask=msk)[0][:, -1].numpy()
            worst = max(worst, rel_diff(out, ref))
    MEASURED["captured decode step (preallocated cache, 5 reordered steps) vs full forward, logits"] = worst
    assert worst <= 1e-5


def test_captured_step_traces_as_one_graph(tiny):
    """What CUDA graph capture needs, checked where there is no GPU: the step reads nothing
    back to the host and takes no data-dependent branch, so ``torch.compile(fullgraph=True)``
    traces it whole, with LoRA layers and with the packed decoding weights; the traced step
    computes the eager step's logits (with no reorder pending, repeating a step changes nothing)."""
    import torch

    from backends.torch._captured_decode import StaticDecoder
    from lora_core.generate.beam import left_pad

    cfg, base = tiny
    bt = lc.get_backend("torch")
    m = bt.build_model(cfg, lc.LoRAConfig(r=4, alpha=8), base).eval()
    ids, mask = left_pad([[5, 6, 7], [8, 9, 10, 11, 12]])
    static, graphs = StaticDecoder(m, 4), []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    traced = torch.compile(static._run, backend=count, fullgraph=True)
    with torch.no_grad():
        cache = static.start(m(ids, attention_mask=mask)[1], 2, mask)
        cache.set_inputs(np.array([1, 2, 3, 4]), cfg)
        for packed in (False, True):
            with m.decoding(rows=4) if packed else contextlib.nullcontext():
                assert torch.equal(traced(cache), static._run(cache))
    assert len(graphs) == 2  # one per weight layout, each whole


def test_resolve_topk_fetches_rows_whose_ties_reach_past_the_margin():
    """A device's top-m in arbitrary tie order becomes the exact (value, then id) ranking; a
    row whose m-th value still ties the k-th is ranked whole on the host."""
    from lora_core.generate.beam_scoring import resolve_topk, row_topk

    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 40)).astype(np.float32)
    x[1, ::3] = 5.0  # 14 tied maxima: more than k + margin
    x[2, [30, 4, 17]] = 7.0  # three tied maxima inside the margin
    m, k = 6, 3
    shuffled = [rng.permutation(np.argsort(-row, kind="stable")[:m]) for row in x]  # top-m, ties in any order
    cols = np.array([c[np.argsort(-x[r, c], kind="stable")] for r, c in enumerate(shuffled)])
    vals = np.take_along_axis(x, cols, 1)
    fetched = []

    def full_rows(rows):
        fetched.append(rows.tolist())
        return x[rows]

    got = resolve_topk(vals, cols, np.zeros(3), k, full_rows)
    assert (got.cols == row_topk(x, k)).all() and (got.vals == np.take_along_axis(x, got.cols, 1)).all()
    assert fetched == [[1]]


def test_nan_logits_are_named_with_either_scoring(backend):
    """A NaN in a row stops the search with the step and the row, whether numpy or the
    framework ranks; host scoring leaves the caller's logits alone unless told to overwrite."""
    import importlib

    gen = importlib.import_module(f"backends.{backend.NAME}.generate")
    if backend.NAME == "torch":
        import torch

        tensor = torch.from_numpy
    else:
        import jittor as jt

        tensor = jt.array
    cfg = BeamConfig(beam=2, stop_ids=(0,), no_repeat_ngram_size=0, min_length=2)
    x = np.random.default_rng(0).normal(size=(4, 30)).astype(np.float32)
    before = x.copy()
    BeamSearch(2, cfg).step(x)
    assert np.array_equal(x, before)  # the stop id was banned on a copy
    x[3, 7] = np.nan
    for logits in (x.copy(), gen.DeviceLogits(tensor(x.copy()))):
        with pytest.raises(FloatingPointError, match=r"step 0: the model returned NaN logits \(rows \[3\]\)"):
            BeamSearch(2, cfg).step(logits)


def test_beam_wider_than_the_vocabulary_is_refused():
    """The first step holds one beam's V candidates: beam > V had too few to fill the beams (an
    IndexError further on); refused naming both."""
    bs = BeamSearch(1, BeamConfig(beam=8, max_new_tokens=3, no_repeat_ngram_size=0, stop_ids=()))
    with pytest.raises(ValueError, match=r"beam 8 is larger than the vocabulary \(6 tokens\)"):
        bs.step(np.zeros((8, 6), np.float32))
    bs = BeamSearch(1, BeamConfig(beam=6, max_new_tokens=3, no_repeat_ngram_size=0, stop_ids=()))
    while not bs.done:  # beam == V works
        bs.step(np.random.default_rng(bs.step_index).normal(size=(6, 6)).astype(np.float32))
    assert len(bs.best[0]) == 3
