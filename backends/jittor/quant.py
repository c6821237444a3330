"""QLoRA's 4-bit frozen base for Jittor (contract: ``backends.torch.quant``): the NF4 state
lives in a tuple attribute (not parameters), and a ``jt.code`` CPU kernel dequantizes it for
each product (``lora_core.quant.nf4``'s steps: ``dyn[q] * nested + offset``, then
``NF4[code] * scale``, each rounded to float32)."""

from __future__ import annotations

import jittor as jt
import numpy as np
from jittor import nn

from lora_core.quant.nf4 import NF4_CODE, NF4State, dynamic_map
from lora_core.quant.qlora import module_of

from ._lean_layers import frozen_matmul_t
from .lora import LoRALinear, LoRAMergedLinear, linear_decode

# A float32 ``v`` rounded to a bfloat16 value in place (to nearest even, NaN kept: torch's and
# bitsandbytes' conversion; jittor's own cast truncates); needs <cstring>
_ROUND_BF16 = """{
            unsigned int u;
            std::memcpy(&u, &v, 4);
            u = (v != v) ? 0x7FC00000u : ((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
            std::memcpy(&v, &u, 4);
        }"""
# ``{scale}``: the block's scale ``s`` (double quantization: ``dyn[code] * nested + offset``,
# a float32 product not fused with the sum; else the float32 absmax); ``{round}``: the weight
# rounded to bfloat16 (``_ROUND_BF16``), or nothing
_SRC = """
    const long n = out0_shape0 * out0_shape1, bs = {bs};
    for (long i = 0; i < n; i++) {{
        const long b = i / bs;
        float s;
        {scale}
        const unsigned char byte = in0_p[i >> 1];
        const int c = (i & 1) ? (byte & 15) : (byte >> 4);
        float v = in4_p[c] * s;
        {round}
        out0_p[i] = v;
    }}
"""
_NESTED_SCALE = """{{
            volatile float prod = in3_p[in1_p[b]] * in2_p[b / {nbs}];  // no fused multiply-add
            s = prod + in2_p[in2_shape0 - 1];
        }}"""
_PLAIN_SCALE = "s = in2_p[b];"


def _kernel(packed, absmax, tail, shape, blocksize: int, nested_blocksize: int | None, bf16: bool) -> jt.Var:
    """The CPU kernel: ``packed`` codes, ``absmax`` per block (uint8 indices into the dynamic map
    with ``nested_blocksize``, else float32), ``tail`` (the nested scales with the offset appended,
    else the float32 absmax again); ``bf16``: each weight rounded to bfloat16 (kept in float32)."""
    scale = _PLAIN_SCALE if nested_blocksize is None else _NESTED_SCALE.format(nbs=nested_blocksize)
    shape = tuple(int(d) for d in shape)
    rows = int(np.prod(shape[:-1], dtype=np.int64))  # the kernel writes a 2-D output
    out = jt.code((rows, shape[-1]), "float32", [packed, absmax, tail, jt.array(dynamic_map()), jt.array(NF4_CODE)],
                  cpu_header="#include <cstring>",
                  cpu_src=_SRC.format(bs=blocksize, scale=scale, round=_ROUND_BF16 if bf16 else ""))
    return out if len(shape) == 2 else out.reshape(shape)


def _flat(x, dtype) -> jt.Var:
    x = x if isinstance(x, jt.Var) else jt.array(np.ascontiguousarray(np.asarray(x, dtype=dtype)))
    return x.reshape(-1)


def dequantize(packed, absmax, nested, offset, shape, blocksize: int, nested_blocksize: int = 256) -> jt.Var:
    """The float32 weight of an NF4 state (``NF4_CODE[code] * scale``, the spec's steps), as
    ``backends.torch.quant.dequantize``: ``packed`` the codes (two a byte), ``absmax`` the block
    scales (with double quantization their uint8 codes, ``nested`` the float32 scales of those in
    blocks of ``nested_blocksize`` and ``offset`` the added mean; else float32, ``nested`` and
    ``offset`` None); Vars or numpy arrays."""
    if nested is None:
        absmax = _flat(absmax, np.float32)
        return _kernel(_flat(packed, np.uint8), absmax, absmax, shape, blocksize, None, False)
    tail = jt.concat([_flat(nested, np.float32), _flat(offset, np.float32)])  # the offset appended
    return _kernel(_flat(packed, np.uint8), _flat(absmax, np.uint8), tail, shape, blocksize, nested_blocksize, False)


def _dequantize_layer(layer, bf16: bool = False) -> jt.Var:
    """The float32 weight of ``layer``'s NF4 state (CPU kernel); ``bf16``: rounded to bfloat16."""
    packed, absmax, tail = layer._nf4
    return _kernel(packed, absmax, tail, layer.shape, layer.blocksize, layer.nested_blocksize if layer.nested else None,
                   bf16)


_ROUND_BF16_SRC = f"""
    for (long i = 0; i < in0_shape0; i++) {{
        float v = in0_p[i];
        {_ROUND_BF16}
        out0_p[i] = v;
    }}
"""


def round_bf16(x: jt.Var) -> jt.Var:
    """``x`` (float32) rounded to bfloat16 values, to nearest even (torch's conversion), kept in float32."""
    flat = jt.code((x.numel(),), "float32", [x.reshape(-1)], cpu_header="#include <cstring>", cpu_src=_ROUND_BF16_SRC)
    return flat.reshape(x.shape)


class _Bf16Product(jt.Function):
    """bitsandbytes' ``Linear4bit`` with a bfloat16 compute dtype, in float32 arithmetic: the input
    and bias rounded to bfloat16, one product with the (bfloat16-valued) weight, the result rounded
    to bfloat16; the backward as torch's for it: the gradient rounded, ``g W`` rounded, the bias
    gradient the rounded gradient's sum, rounded. Products of bfloat16 values are exact in float32;
    the sums run in another order than torch's bfloat16 GEMM, so an element can round to the next
    bfloat16 value (2^-8 relative) where torch's lands on the other side of a midpoint."""

    def execute(self, x, w, bias=None):
        self.w, self.has_bias = w, bias is not None
        y = nn.matmul_transpose(round_bf16(x), w)
        return round_bf16(y + round_bf16(bias) if bias is not None else y)

    def grad(self, g):
        g = round_bf16(g)
        g2 = g.reshape(-1, g.shape[-1])
        gx = round_bf16(nn.matmul(g2, self.w)).reshape(g.shape[:-1] + (self.w.shape[1],))
        return (gx, None, round_bf16(g2.sum(0))) if self.has_bias else (gx, None)


class LoRALinear4bit(LoRALinear):
    """A frozen NF4 ``(out, in)`` weight plus ``LoRALinear``'s LoRA pair (``add_lora``)."""

    is_4bit = True  # its merged weight is unpacked from the codes (lora_core.lora.layers.decoding_weights)

    def __init__(self, state: NF4State, bias=None, compute_dtype: str = "float32"):
        self.out_features, self.in_features = state.shape
        self.r, self.scaling, self.p, self.merged = 0, 0.0, 0.0, False
        self.lora_dropout, self.mask_source, self.decode_weight = nn.Identity(), None, None
        self.enable_lora, self.enabled = None, []  # per-slice LoRA on a fused projection (add_lora)
        self.bias = bias
        self.shape, self.blocksize, self.nested_blocksize = tuple(state.shape), state.blocksize, state.nested_blocksize
        self.quant_dtype, self.compute_dtype_name = state.dtype, compute_dtype  # written back on saving
        self.nested, self.compute_dtype = state.nested, compute_dtype
        # nested scales with the offset appended (one float32 input to the kernel)
        tail = np.concatenate([state.nested_absmax, [state.offset]]).astype(np.float32) if state.nested \
            else np.asarray(state.absmax, np.float32)
        self._nf4 = (jt.array(np.ascontiguousarray(state.packed).reshape(-1)),
                     jt.array(np.ascontiguousarray(state.absmax).reshape(-1).astype(np.uint8 if state.nested else np.float32)),
                     jt.array(tail))

    @property
    def weight(self) -> jt.Var:
        """The dequantized weight (float32, no gradient), for reading."""
        return self.dequantized()

    def dequantized(self, dtype=jt.float32) -> jt.Var:
        """The weight in ``dtype`` (a jittor dtype or its name; no gradient), rounded to the compute
        dtype on the way, as torch's: float32 -> compute dtype -> ``dtype`` (bfloat16: to nearest
        even, as torch converts; jittor's own cast truncates)."""
        w = _dequantize_layer(self, bf16=self.compute_dtype == "bfloat16").stop_grad()
        name = dtype if isinstance(dtype, str) else dtype.__name__
        if name == "float32":
            return w
        if name == "bfloat16":
            w = round_bf16(w)  # to nearest even (a no-op where the kernel rounded): the cast is then exact
        return w.cast(name)

    def add_lora(self, r: int, scaling: float, dropout: float, values, enable=None) -> None:
        """Put a LoRA pair (numpy ``A`` (r, in), ``B`` (out, r)) on this layer; ``enable``: one
        pair per enabled slice of a fused projection (see the torch backend)."""
        self.enable_lora = None if enable is None else tuple(enable)
        self.enabled = [i for i, on in enumerate(self.enable_lora or ()) if on]
        self.r, self.scaling, self.p = r, scaling, dropout
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = jt.array(np.ascontiguousarray(values[0], np.float32))
        self.lora_B = jt.array(np.ascontiguousarray(values[1], np.float32))

    def _slice_out(self) -> int:
        return self.out_features // len(self.enable_lora) if self.enable_lora else self.out_features

    def _lora_out(self, x: jt.Var, base: jt.Var) -> jt.Var:
        return (LoRAMergedLinear if self.enable_lora else LoRALinear)._lora_out(self, x, base)

    def delta_weight(self) -> jt.Var:
        return (LoRAMergedLinear if self.enable_lora else LoRALinear).delta_weight(self)

    def input_grad(self, g: jt.Var) -> jt.Var:
        """``g W`` of the dequantized base weight."""
        return jt.matmul(g, self.dequantized())

    def execute(self, x: jt.Var) -> jt.Var:
        if self.decode_weight is not None:  # inside model.decoding(): the weight unpacked once, LoRA merged
            return linear_decode(x, self.decode_weight, self.bias)
        if self.compute_dtype == "bfloat16":  # bitsandbytes' bfloat16 product (_Bf16Product)
            w = self.dequantized()
            y = _Bf16Product.apply(x, w, self.bias) if self.bias is not None else _Bf16Product.apply(x, w)
        else:
            y = frozen_matmul_t(x, self.dequantized())
            if self.bias is not None:
                y = y + self.bias
        if self.r:
            y = self._lora_out(x, y)
        return y

    def merge(self) -> None:
        raise NotImplementedError("a 4-bit base layer cannot hold a merged LoRA update; dequantize first")


def to_4bit(model: nn.Module, states: dict, qcfg) -> None:
    """Replace the modules named by ``states`` (canonical weight names) by 4-bit layers."""
    mods = dict(model.named_modules())
    for name, st in states.items():
        parent, _, child = module_of(name).rpartition(".")
        owner = mods[parent]
        old = getattr(owner, child)
        setattr(owner, child, LoRALinear4bit(st, getattr(old, "bias", None), qcfg.compute_dtype))


def empty_model(model_cls, cfg):
    """``model_cls(cfg)``: jittor's zeros are lazy, nothing is allocated until used."""
    return model_cls(cfg)


def from_pretrained_4bit(path, adapter=None, quantize=None, double_quant: bool | None = None,
                         compute_dtype: str | None = None, blocksize: int | None = None, explicit=None):
    """A QLoRA base (Llama family or GPT-2); see ``lora_core.quant.checkpoint4bit.build_4bit_model``."""
    from lora_core.quant.checkpoint4bit import build_4bit_model

    from .gpt2 import GPT2LMModel
    from .inject import load_lora_adapter
    from .llama import LlamaForCausalLM

    return build_4bit_model({"llama": LlamaForCausalLM, "gpt2": GPT2LMModel}, empty_model, to_4bit, load_lora_adapter,
                            path, adapter, quantize, double_quant, compute_dtype, blocksize, explicit)


def save_quantized(model, folder) -> None:
    """Save a 4-bit model's base as a bitsandbytes checkpoint folder that transformers loads
    (``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")``); LoRA is not part of
    it (``save_lora_adapter``). See ``lora_core.quant.checkpoint4bit.save_4bit_model``."""
    from lora_core.quant.checkpoint4bit import save_4bit_model

    save_4bit_model(model, folder, LoRALinear4bit, _state_of)


def _state_of(m: LoRALinear4bit) -> NF4State:
    packed, absmax, tail = (v.numpy() for v in m._nf4)
    st = NF4State(packed.reshape(-1, 1), absmax, m.shape, m.blocksize, m.quant_dtype)
    if m.nested:
        st.nested_absmax, st.offset, st.nested_blocksize = tail[:-1].copy(), np.float32(tail[-1]), m.nested_blocksize
    return st


__all__ = ["LoRALinear4bit", "dequantize", "empty_model", "from_pretrained_4bit", "save_quantized", "to_4bit"]
