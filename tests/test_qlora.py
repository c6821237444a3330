"""QLoRA: a 4-bit NF4 base (lora_core.quant) in both backends, loaded from a tiny random
transformers Llama checkpoint, quantized while loading.

Checks: the base's weights are the spec's dequantized NF4 (and bitsandbytes' where its codes
agree, tests/test_nf4.py); QLoRA logits and LoRA gradients equal those of LoRA on the
dequantized float32 base; jittor against torch (logits and a short training loss curve)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lora_core import LoRATargetConfig
from lora_core.models.llama import init_llama_weights, llama_config
from lora_core.quant import nf4
from lora_core.quant.qlora import is_quantized_weight

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]
safetensors_torch = pytest.importorskip("safetensors.torch")

CFG = llama_config("tiny-llama")
TARGET = LoRATargetConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    import json

    d = tmp_path_factory.mktemp("tiny_llama")
    w = init_llama_weights(CFG, seed=3)
    safetensors_torch.save_file({k: torch.from_numpy(v) for k, v in w.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    return d, w


def _np(x):
    return x.detach().cpu().numpy() if hasattr(x, "detach") else x.numpy()


def _dequantized_base(w):
    return {k: (nf4.dequantize_nf4(nf4.quantize_nf4(v)) if is_quantized_weight(k) else v) for k, v in w.items()}


def _ids():
    return np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 9))


def _lora_values(model, bk):
    """Seeded numpy LoRA values (B nonzero so that gradients reach A too), set in place."""
    rng = np.random.default_rng(7)
    vals = {n: (rng.standard_normal(tuple(p.shape)) * 0.05).astype(np.float32)
            for n, p in bk.trainable_parameters(model).items()}
    model.load_partial(vals)
    return vals


def _loss_and_grads(bk, model, ids):
    if bk.NAME == "torch":
        logits, _ = model(torch.from_numpy(ids))
        loss = logits.float().pow(2).mean()
        params = bk.trainable_parameters(model)
        grads = torch.autograd.grad(loss, list(params.values()))
        return _np(logits), {n: _np(g) for n, g in zip(params, grads)}
    import jittor as jt

    logits, _ = model(jt.array(ids))
    loss = (logits * logits).mean()
    params = bk.trainable_parameters(model)
    grads = jt.grad(loss, list(params.values()))
    return logits.numpy(), {n: g.numpy() for n, g in zip(params, grads)}


def _scale(x):
    return max(float(np.abs(x).max()), 1e-30)


def test_qlora_equals_lora_on_dequantized_base(backend, ckpt, tmp_path):
    d, w = ckpt
    q = backend.from_pretrained(d, quantize="nf4")
    backend.inject_lora(q, TARGET)
    vals = _lora_values(q, backend)
    # the reference: plain LoRA on the dequantized float32 base, saved as a checkpoint
    ref_dir = tmp_path / "deq"
    ref_dir.mkdir()
    safetensors_torch.save_file({k: torch.from_numpy(v) for k, v in _dequantized_base(w).items()},
                                str(ref_dir / "model.safetensors"))
    (ref_dir / "config.json").write_text((d / "config.json").read_text())
    ref = backend.from_pretrained(ref_dir)
    backend.inject_lora(ref, TARGET)
    ref.load_partial(vals)
    lq, gq = _loss_and_grads(backend, q, _ids())
    lr, gr = _loss_and_grads(backend, ref, _ids())
    assert np.abs(lq - lr).max() <= 1e-5 * _scale(lr)
    assert gq.keys() == gr.keys() and len(gq) == 2 * 3 * CFG.num_hidden_layers
    for n in gq:
        assert np.abs(gq[n] - gr[n]).max() <= 1e-5 * _scale(gr[n]), n
    # the 4-bit layers hold the spec's dequantized weights
    layer = q.model.layers[0].self_attn.q_proj
    assert np.array_equal(_np(layer.weight), _dequantized_base(w)["model.layers.0.self_attn.q_proj.weight"])


def test_jittor_matches_torch(ckpt):
    from lora_core import get_backend

    d, _ = ckpt
    out = {}
    for name in ("torch", "jittor"):
        bk = get_backend(name)
        m = bk.from_pretrained(d, quantize="nf4")
        bk.inject_lora(m, TARGET)
        _lora_values(m, bk)
        logits, grads = _loss_and_grads(bk, m, _ids())
        out[name] = logits, grads
    (lt, gt), (lj, gj) = out["torch"], out["jittor"]
    assert np.abs(lt - lj).max() <= 1e-5 * _scale(lt)
    for n in gt:
        assert np.abs(gt[n] - gj[n]).max() <= 1e-5 * _scale(gt[n]), n


def test_refusals(ckpt):
    from lora_core import get_backend

    bk = get_backend("torch")
    d, _ = ckpt
    with pytest.raises(ValueError, match="only 'nf4'"):
        bk.from_pretrained(d, quantize="fp4")
    with pytest.raises(ValueError, match="block size bitsandbytes allows"):
        bk.from_pretrained(d, quantize="nf4", blocksize=100)
    with pytest.raises(ValueError, match="quantize='nf4' only"):
        bk.from_pretrained(d, double_quant=False)


def test_torch_layer_uses_bitsandbytes_kernel_bit_identically():
    """Where rows are whole blocks, torch's 4-bit layer dequantizes with bitsandbytes' CPU kernel:
    the same bits as the pure-torch steps (and the numpy spec)."""
    pytest.importorskip("bitsandbytes")
    import torch

    from backends.torch import quant as tq
    from lora_core.quant.nf4 import dequantize_nf4, quantize_nf4

    w = np.random.default_rng(3).normal(0, 0.05, (192, 128)).astype(np.float32)
    state = quantize_nf4(w, 64, True)
    layer = tq.LoRALinear4bit(state)
    fast = tq._bnb_dequantize(layer)
    assert fast is not None
    ref = tq.dequantize(layer.packed, layer.absmax, layer.nested_absmax, layer.offset, layer.shape, 64, 256)
    assert torch.equal(fast, ref) and np.array_equal(fast.numpy(), dequantize_nf4(state))


def test_torch_code_tables_go_to_a_device_once():
    """The NF4 and 8-bit code tables are copied to a device once, not per product (on a GPU a
    blocking host-to-device copy per product waited for the GPU: measured in QLoRA on an H200);
    on the CPU the tables themselves. ("meta" stands in for a GPU here.)"""
    import torch

    from backends.torch import quant as tq

    meta = torch.device("meta")
    nf4_there, dyn_there = tq._table(tq._NF4, meta), tq._table(tq._DYN, meta)
    assert nf4_there.device == meta and nf4_there.shape == tq._NF4.shape and dyn_there.shape == tq._DYN.shape
    assert tq._table(tq._NF4, meta) is nf4_there and tq._table(tq._DYN, meta) is dyn_there
    assert tq._table(tq._NF4, torch.device("cpu")) is tq._NF4


def test_torch_device_path_dequantizes_into_the_compute_dtype_with_one_quant_state(monkeypatch):
    """The path a GPU takes (bitsandbytes' ``dequantize_4bit``; driven here on the CPU with the
    host kernel turned off): under bf16 autocast each product's weight comes out in bf16, the
    bits autocast's own cast of the float32 weight gives (outputs and input gradients equal to
    the float32 weight's under autocast); the layer's ``QuantState`` is made once per device and
    dtype, not per product, and again once its buffers are replaced."""
    bnb_f = pytest.importorskip("bitsandbytes.functional")
    import torch

    from backends.torch import quant as tq
    from lora_core.quant.nf4 import quantize_nf4

    rng = np.random.default_rng(5)
    layer = tq.LoRALinear4bit(quantize_nf4(rng.normal(0, 0.05, (192, 128)).astype(np.float32), 64, True))
    w = tq.dequantize(layer.packed, layer.absmax, layer.nested_absmax, layer.offset, layer.shape, 64, 256)
    x = torch.from_numpy(rng.normal(size=(6, 128)).astype(np.float32))
    gy = torch.from_numpy(rng.normal(size=(6, 192)).astype(np.float32)).bfloat16()

    def run(fn):
        xr = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(xr)
        (g,) = torch.autograd.grad(y, xr, gy)
        return y, g

    y_ref, g_ref = run(lambda t: torch.nn.functional.linear(t, w))
    monkeypatch.setattr(tq, "_ON_HOST", False)
    dtypes = []
    real = bnb_f.dequantize_4bit
    monkeypatch.setattr(bnb_f, "dequantize_4bit", lambda A, qs: dtypes.append(qs.dtype) or real(A, qs))
    y, g = run(layer)
    assert dtypes == [torch.bfloat16, torch.bfloat16]  # forward and backward, no float32 copy
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref) and torch.equal(g, g_ref)
    states = dict(layer._quant_states)
    run(layer)
    assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight, w)
    assert len(states) == 1 and all(layer._quant_states[k] is v for k, v in states.items())
    assert set(layer._quant_states) == {("cpu", torch.bfloat16), ("cpu", torch.float32)}
    layer.absmax = layer.absmax.clone()  # replaced (as moving the layer replaces it): made again
    run(layer)
    assert layer._quant_states[("cpu", torch.bfloat16)] is not states[("cpu", torch.bfloat16)]


@pytest.mark.parametrize("double_quant", [True, False])
def test_torch_products_dequantize_rows_into_one_shared_buffer_bit_identically(double_quant, monkeypatch):
    """A 4-bit product dequantizes its weight a few rows at a time (at most ``CHUNK_BYTES``) into
    one buffer shared by every layer (no fresh 64 MB allocation per product, no whole float32
    weight at all): the same bits as bitsandbytes' ``dequantize_4bit`` and the numpy spec, the
    forward output and input gradient of the dequantized weight (the gradient's sum over row
    pieces in another order: within 1e-6 of the largest |value|), without importing the
    bitsandbytes package."""
    pytest.importorskip("bitsandbytes")
    import torch

    from backends.torch import quant as tq
    from lora_core.quant.nf4 import dequantize_nf4, quantize_nf4

    monkeypatch.setattr(tq, "CHUNK_BYTES", 48 * 128 * 4)  # 192 rows of 128 in four pieces
    rng = np.random.default_rng(5)
    states = [quantize_nf4(rng.normal(0, 0.05, (192, 128)).astype(np.float32), 64, double_quant) for _ in range(2)]
    layers = [tq.LoRALinear4bit(s) for s in states]
    assert tq._row_blocks(layers[0]) == [(0, 48), (48, 96), (96, 144), (144, 192)]
    for layer, s in zip(layers, states):
        absmax = tq._absmax_for_kernel(layer)
        pieces = [tq._dequantize_rows(layer, absmax, a, b).clone() for a, b in tq._row_blocks(layer)]
        assert np.array_equal(torch.cat(pieces).numpy(), dequantize_nf4(s))
        assert torch.equal(torch.cat(pieces), tq._bnb_dequantize(layer))
    a, b = tq._row_blocks(layers[0])[1]
    assert tq._dequantize_rows(layers[0], tq._absmax_for_kernel(layers[0]), a, b).data_ptr() == \
        tq._dequantize_rows(layers[1], tq._absmax_for_kernel(layers[1]), a, b).data_ptr()  # fmt: skip
    x = torch.from_numpy(rng.normal(size=(5, 128)).astype(np.float32)).requires_grad_()
    for layer, s in zip(layers, states):
        w = torch.from_numpy(dequantize_nf4(s))
        y = layer(x)
        gy = torch.from_numpy(rng.normal(size=y.shape).astype(np.float32))
        (g,) = torch.autograd.grad(y, x, gy)
        assert torch.equal(y, torch.nn.functional.linear(x, w))
        assert float((g - gy @ w).abs().max()) <= 1e-6 * float((gy @ w).abs().max())
    import bitsandbytes.functional as bnb_f  # the reference (ours does not import the package)

    for layer in layers:
        qs = bnb_f.QuantState(absmax=layer.absmax, shape=torch.Size(layer.shape), code=tq._NF4, blocksize=64,
                              quant_type="nf4", dtype=torch.float32, offset=layer.offset,
                              state2=None if layer.nested_absmax is None else bnb_f.QuantState(
                                  absmax=layer.nested_absmax, code=tq._DYN, blocksize=256, dtype=torch.float32))  # fmt: skip
        assert torch.equal(tq._bnb_dequantize(layer), bnb_f.dequantize_4bit(layer.packed.view(-1, 1), qs))
    bf16 = tq.LoRALinear4bit(states[0], compute_dtype="bfloat16")
    assert torch.equal(bf16.dequantized(), tq._bnb_dequantize(layers[0]).bfloat16().float())  # the copying path
    script = ("import sys, torch, numpy as np; from backends.torch import quant as tq; "
              "from lora_core.quant.nf4 import quantize_nf4; "
              "l = tq.LoRALinear4bit(quantize_nf4(np.ones((64, 128), np.float32), 64, True)); "
              "t = tq.LoRALinear4bit(quantize_nf4(np.ones((3, 32), np.float32), 64, True)); "
              "l(torch.ones(2, 128)); t(torch.ones(2, 32)); l.weight; t.weight; "
              "assert tq._bnb_cpu_lib() is not None; print('bitsandbytes' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_qlora_decoding_weights_give_the_plain_logits_and_greedy_tokens(backend, ckpt):
    """Decoding on a 4-bit base: inside ``decoding`` every 4-bit projection's weight is unpacked
    once (an attention block's q, k and v stacked into one product) and the logits are the
    plain path's (dequantized per product), for the few rows of greedy decoding and the many of
    beams; greedy decoding through the KV cache gives the tokens of the argmax loop without one."""
    from lora_core.generate.beam import BeamConfig

    d, _ = ckpt
    q = backend.from_pretrained(d, quantize="nf4")
    backend.inject_lora(q, TARGET)
    _lora_values(q, backend)
    q.eval()
    ids = _ids()
    plain = _np(q(_tensor(backend, ids))[0])
    attn = q.model.layers[0].self_attn
    for rows in (2, 80):
        with q.decoding(rows=rows):
            assert attn.decode_fused is not None and attn.k_proj.decode_weight is None
            got = _np(q(_tensor(backend, ids))[0])
        assert np.abs(got - plain).max() <= 1e-5 * _scale(plain), rows
    ctx = ids.tolist()
    want = []
    for row in ctx:
        seq = list(row)
        for _ in range(6):
            seq.append(int(np.argmax(_np(q(_tensor(backend, np.array([seq])))[0])[0, -1])))
        want.append(seq[len(row):])
    cfg = BeamConfig(beam=1, max_new_tokens=6, no_repeat_ngram_size=0, stop_ids=())
    assert backend.beam_search(q, ctx, cfg, batch_size=2) == want


def _tensor(bk, x):
    if bk.NAME == "torch":
        return torch.from_numpy(x)
    import jittor as jt

    return jt.array(x)


def _bnb_layer(bias: bool):
    """bitsandbytes' ``Linear4bit`` (NF4, double quantization, bfloat16 compute) and our torch
    layer on its state."""
    import bitsandbytes as bnb

    torch.manual_seed(0)
    lin = bnb.nn.Linear4bit(64, 96, bias=bias, compute_dtype=torch.bfloat16, quant_type="nf4")
    lin.weight = bnb.nn.Params4bit(torch.randn(96, 64), requires_grad=False, quant_type="nf4", compress_statistics=True)
    lin = lin.to("cpu")
    if bias:
        with torch.no_grad():
            lin.bias.copy_(torch.randn(96))
    st = lin.weight.quant_state
    state = nf4.NF4State(lin.weight.data.numpy(), st.absmax.numpy(), (96, 64), 64, "float32", st.state2.absmax.numpy(),
                         np.float32(st.offset.item()))  # fmt: skip
    return lin, state


@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_compute_is_bitsandbytes_product(bias):
    """``compute_dtype="bfloat16"``: input, weight and bias in bfloat16, one product, the result
    back in float32 (bitsandbytes' ``Linear4bit``): output and gradients bit for bit; jittor's
    float32 emulation of it gives the same numbers here (an element may round to the next
    bfloat16 value where torch's bfloat16 GEMM sums in another order)."""
    from backends.torch.quant import LoRALinear4bit

    lin, state = _bnb_layer(bias)
    ours = LoRALinear4bit(state, torch.nn.Parameter(lin.bias.detach().clone()) if bias else None, "bfloat16")
    x = torch.randn(5, 64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = lin(x1), ours(x2)
    g = torch.randn_like(a)
    a.backward(g)
    b.backward(g)
    assert torch.equal(a, b) and torch.equal(x1.grad, x2.grad)
    assert not bias or torch.equal(lin.bias.grad, ours.bias.grad)
    import lora_core as lc

    lc.get_backend("jittor")
    import jittor as jt

    from backends.jittor.quant import LoRALinear4bit as J4

    j = J4(state, jt.array(ours.bias.detach().numpy()) if bias else None, "bfloat16")  # (bitsandbytes' now bf16)
    xj = jt.array(x.numpy())
    yj = j(xj)
    grads = jt.grad((yj * jt.array(g.numpy())).sum(), [xj] + ([j.bias] if bias else []))
    assert np.array_equal(yj.numpy(), b.detach().numpy()) and np.array_equal(grads[0].numpy(), x2.grad.numpy())
    assert not bias or np.array_equal(grads[1].numpy(), ours.bias.grad.numpy())


@pytest.mark.parametrize("double_quant", [True, False])
def test_jittor_dequantizes_with_and_without_double_quant(double_quant):
    """Jittor's kernel with float32 block scales (no double quantization: its nested branch once
    failed to compile) and with bfloat16 compute (rounded to nearest even, as torch converts)."""
    import lora_core as lc

    lc.get_backend("jittor")
    from backends.jittor.quant import LoRALinear4bit as J4

    w = np.random.default_rng(2).standard_normal((8, 192)).astype(np.float32)
    st = nf4.quantize_nf4(w, 64, double_quant=double_quant)
    assert np.array_equal(J4(st).dequantized().numpy(), nf4.dequantize_nf4(st))
    want = torch.from_numpy(nf4.dequantize_nf4(st)).bfloat16().float().numpy()
    assert np.array_equal(J4(st, compute_dtype="bfloat16").dequantized().numpy(), want)
