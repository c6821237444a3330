"""QLoRA's 4-bit frozen base for PyTorch: ``LoRALinear4bit`` holds an NF4 weight (layout and
rounding: ``lora_core.quant.nf4``; which weights: ``lora_core.quant.qlora``) and dequantizes
it for each product, forward and backward (nothing of the dequantized weight is kept between
them), LoRA on top as in ``LoRALinear``."""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lora_core.quant.nf4 import NF4_CODE, NF4State, dynamic_map
from lora_core.quant.qlora import module_of

from .lora import LoRALinear, LoRAMergedLinear, linear_decode

_NF4 = torch.from_numpy(NF4_CODE)
_DYN = torch.from_numpy(dynamic_map())
_ON_DEVICE: dict = {}  # (table, device) -> the table there: copied once, not per product


def _table(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``_NF4`` or ``_DYN`` on ``device``, copied there once per process: a copy from the host
    per product would also wait for the GPU (a blocking host-to-device copy synchronizes its
    stream), seven times per layer and pass in QLoRA."""
    if device.type == "cpu":
        return t
    key = (id(t), str(device))
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = t.to(device)
    return _ON_DEVICE[key]


def dequantize(packed, absmax, nested, offset, shape, blocksize: int, nested_blocksize: int = 256) -> torch.Tensor:
    """The float32 weight of an NF4 state (``NF4_CODE[code] * scale``, the spec's steps)."""
    n = int(np.prod(shape))
    codes = torch.stack([packed.view(-1) >> 4, packed.view(-1) & 15], dim=1).view(-1)[:n].long()
    if nested is not None:
        scale = _table(_DYN, absmax.device)[absmax.long()] * nested.repeat_interleave(nested_blocksize)[:absmax.numel()]
        scale = scale + offset
    else:
        scale = absmax
    return (_table(_NF4, packed.device)[codes] * scale.repeat_interleave(blocksize)[:n]).view(shape)


_BNB = []  # bitsandbytes.functional once imported, or None where it is not installed


def _bnb_dequantize(layer, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """The layer's weight (a fresh tensor) by bitsandbytes' kernels: on the CPU its native
    NF4 kernel, loaded by itself (``_bnb_cpu_lib``: the package is not imported), float32;
    elsewhere (CUDA) its ``dequantize_4bit`` straight into ``dtype`` (float32, or the 16-bit
    dtype a product under autocast computes in: the float32 value rounded once, as ``.to(dtype)``
    rounds it, without a float32 copy to write and cast), with the layer's ``QuantState`` made
    once per device and dtype (:func:`_quant_state`); bit-identical to ``dequantize`` here,
    measured 23x faster for a 2816 x 1024 weight. None without bitsandbytes or where a block
    spans two rows (rows not a multiple of the block: 0.50.2's CPU kernel scales such a block
    by another block's absmax)."""
    if layer.shape[-1] % layer.blocksize:
        return None
    if _ON_HOST and layer.packed.device.type == "cpu":
        absmax = _absmax_for_kernel(layer)
        if absmax is None:
            return None
        rows = int(np.prod(layer.shape[:-1]))
        out = torch.empty(rows * layer.shape[-1], dtype=torch.float32)
        return _dequantize_rows(layer, absmax, 0, rows, out).view(layer.shape)
    bnb_f = _import_bnb()
    if bnb_f is None:
        return None
    return bnb_f.dequantize_4bit(layer.packed.view(-1, 1), _quant_state(layer, bnb_f, dtype))


_ON_HOST = True  # CPU layers take the native kernel (tests turn it off to drive the device path on the CPU)


def _quant_state(layer, bnb_f, dtype: torch.dtype):
    """bitsandbytes' ``QuantState`` of ``layer`` with output ``dtype``, kept on the layer per
    device and dtype (made again only when its buffers were replaced, e.g. moved): not two new
    objects and two table lookups per product (on a GPU each product's Python time is time the
    device may wait for)."""
    key = (str(layer.packed.device), dtype)
    qs = layer._quant_states.get(key)
    if qs is not None and qs.absmax is layer.absmax and (qs.state2 is None or qs.state2.absmax is layer.nested_absmax):
        return qs
    dev = layer.packed.device
    nested = None
    if layer.nested_absmax is not None:
        nested = bnb_f.QuantState(absmax=layer.nested_absmax, code=_table(_DYN, dev), blocksize=layer.nested_blocksize,
                                  dtype=torch.float32)
    qs = bnb_f.QuantState(absmax=layer.absmax, shape=torch.Size(layer.shape), code=_table(_NF4, dev),
                          blocksize=layer.blocksize, quant_type="nf4", dtype=dtype, offset=layer.offset, state2=nested)
    layer._quant_states[key] = qs
    return qs


def _product_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a product with ``x`` computes in: autocast's where it is on for ``x``'s device
    (the weight handed over in it is what autocast's own cast would make), else ``x``'s."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


CHUNK_BYTES = 16 << 20  # a product dequantizes at most this much of its weight at a time
_SCRATCH: list = []  # one float32 CPU buffer of CHUNK_BYTES that every product dequantizes into


def _scratch(n: int) -> torch.Tensor:
    if not _SCRATCH or _SCRATCH[0].numel() < n:
        _SCRATCH[:] = [torch.empty(max(n, CHUNK_BYTES // 4), dtype=torch.float32)]
    return _SCRATCH[0][:n]


def _absmax_for_kernel(layer) -> torch.Tensor | None:
    """The layer's per-block float32 absmax as bitsandbytes' ``dequantize_4bit`` computes it
    (the 8-bit absmax dequantized by its blockwise kernel, plus the offset), or None where its
    CPU NF4 fp32 kernel does not apply (``dequantize`` then): no bitsandbytes library, a weight
    off the CPU, rows not whole blocks (0.50.2's kernel scales a block that spans two rows by
    another block's absmax)."""
    lib = _bnb_cpu_lib()
    cols = layer.shape[-1]
    if lib is None or not _ON_HOST or layer.packed.device.type != "cpu" or cols % layer.blocksize or cols % 2 or layer.blocksize >= 2048:
        return None
    if layer.nested_absmax is None:
        return layer.absmax.float().contiguous()
    code = _DYN.contiguous()
    absmax = torch.empty(layer.absmax.numel(), dtype=torch.float32)
    lib.cdequantize_blockwise_cpu_fp32(_ptr(code), _ptr(layer.absmax), _ptr(layer.nested_absmax), _ptr(absmax),
                                       ctypes.c_longlong(layer.nested_blocksize), ctypes.c_longlong(absmax.numel()))  # fmt: skip
    absmax += layer.offset
    return absmax


def _ptr(t: torch.Tensor, offset: int = 0) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() + offset * t.element_size())


def _dequantize_rows(layer, absmax: torch.Tensor, a: int, b: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``a:b`` of the layer's float32 weight, by bitsandbytes' CPU NF4 kernel, written into
    the shared buffer (``_SCRATCH``): a fresh allocation per product would be one above glibc's
    mmap threshold, whose page faults cost more than the dequantization (measured, 8192 x 2048,
    one thread: 33 ms dequantized fresh, 12-26 ms into a kept buffer). The same kernel and absmax
    steps as ``bitsandbytes.functional.dequantize_4bit``, so the same bits. ``out``: write there instead."""
    cols = layer.shape[-1]
    out = _scratch((b - a) * cols) if out is None else out
    _bnb_cpu_lib().cdequantize_blockwise_cpu_nf4_fp32(
        _ptr(layer.packed, a * cols // 2), _ptr(absmax, a * cols // layer.blocksize), _ptr(out),
        ctypes.c_longlong(layer.blocksize), ctypes.c_longlong(b - a), ctypes.c_longlong(cols))  # fmt: skip
    return out.view(b - a, cols)


def _row_blocks(layer) -> list[tuple[int, int]]:
    """Row ranges of at most ``CHUNK_BYTES`` of float32 weight each."""
    rows, cols = int(np.prod(layer.shape[:-1])), layer.shape[-1]
    step = max(1, CHUNK_BYTES // (4 * cols))
    return [(a, min(rows, a + step)) for a in range(0, rows, step)]


def _import_bnb():
    """``bitsandbytes.functional``, imported once (``_BNB``), or None where it is not installed
    (off the CPU only: the CPU path loads the native library by itself)."""
    if not _BNB:
        try:
            import bitsandbytes.functional as bnb_f
        except ImportError:  # the quant extra is not installed: ``dequantize`` does it
            bnb_f = None
        _BNB.append(bnb_f)
    return _BNB[0]


_LIB = []
_KERNELS = ("cdequantize_blockwise_cpu_nf4_fp32", "cdequantize_blockwise_cpu_fp32")


def _bnb_cpu_lib():
    """bitsandbytes' native CPU library where it has the NF4 and 8-bit fp32 kernels, else None.
    Loaded by itself with ctypes, as bitsandbytes loads it: importing the Python package would
    import torch's compiler stack with it (624 modules, 44 MB of private memory, measured)."""
    if not _LIB:
        lib = None
        spec = importlib.util.find_spec("bitsandbytes")
        for folder in (spec.submodule_search_locations or []) if spec else []:
            path = Path(folder) / "libbitsandbytes_cpu.so"
            if path.exists():
                try:
                    lib = ctypes.CDLL(str(path))
                except OSError:
                    lib = None
                break
        _LIB.append(lib if lib is not None and all(hasattr(lib, k) for k in _KERNELS) else None)
    return _LIB[0]


class _Matmul4bit(torch.autograd.Function):
    """``x W^T`` with W dequantized here and again for the input gradient (W is frozen), at most
    ``CHUNK_BYTES`` of rows at a time into one buffer shared by every layer (``_row_blocks``:
    Llama-3.2-1B's MLP weights, 64 MB in float32, go in four pieces of 16 MB); where the kernel
    does not apply, the whole dequantized weight (``LoRALinear4bit.dequantized``)."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        absmax = _absmax_for_kernel(layer) if x.dtype == layer.compute_dtype == torch.float32 else None
        if absmax is None:
            return F.linear(x, layer.dequantized(_product_dtype(x)))
        blocks = _row_blocks(layer)
        if len(blocks) == 1:
            return F.linear(x, _dequantize_rows(layer, absmax, *blocks[0]))
        x2 = x.reshape(-1, x.shape[-1])
        y = x2.new_empty(x2.shape[0], blocks[-1][1])
        for a, b in blocks:
            y[:, a:b] = x2 @ _dequantize_rows(layer, absmax, a, b).t()
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, g):
        return _input_grad(ctx.layer, g), None


def _input_grad(layer, g: torch.Tensor) -> torch.Tensor:
    """``g W`` with the 4-bit weight dequantized (in row pieces where the kernel applies)."""
    absmax = _absmax_for_kernel(layer) if g.dtype == layer.compute_dtype == torch.float32 else None
    if absmax is None:
        return g @ layer.dequantized(g.dtype)
    g2 = g.reshape(-1, g.shape[-1])
    gx = None
    for a, b in _row_blocks(layer):
        w = _dequantize_rows(layer, absmax, a, b)
        gx = g2[:, a:b] @ w if gx is None else gx.addmm_(g2[:, a:b], w)
    return gx.view(*g.shape[:-1], -1)


class LoRALinear4bit(LoRALinear):
    """A frozen NF4 ``(out, in)`` weight plus ``LoRALinear``'s LoRA pair (added by ``add_lora``)."""

    is_4bit = True  # a 4-bit base: its training steps trim the heap by default (lora_core.train.heap.wanted)

    def __init__(self, state: NF4State, bias: nn.Parameter | None = None, compute_dtype: str = "float32"):
        nn.Module.__init__(self)
        self.out_features, self.in_features = state.shape
        self.r, self.scaling, self.p, self.merged = 0, 0.0, 0.0, False
        self.lora_dropout, self.mask_source, self.decode_weight = nn.Identity(), None, None
        self.enable_lora, self.enabled = None, []  # per-slice LoRA on a fused projection (add_lora)
        self.bias = bias
        self.shape, self.blocksize, self.nested_blocksize = tuple(state.shape), state.blocksize, state.nested_blocksize
        self.quant_dtype, self.compute_dtype_name = state.dtype, compute_dtype  # written back on saving
        self.compute_dtype = getattr(torch, compute_dtype)
        self.register_buffer("packed", torch.from_numpy(np.ascontiguousarray(state.packed)))
        self.register_buffer("absmax", torch.from_numpy(np.ascontiguousarray(state.absmax)))
        nested = None if not state.nested else torch.from_numpy(np.ascontiguousarray(state.nested_absmax))
        self.register_buffer("nested_absmax", nested)
        self.register_buffer("offset", None if not state.nested else torch.tensor(float(state.offset)))
        self._quant_states: dict = {}  # (device, dtype) -> bitsandbytes' QuantState (_quant_state)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (float32, no gradient): a copy, for reading."""
        return self.dequantized(torch.float32)

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        """The weight in ``dtype``, rounded to the compute dtype on the way (as bitsandbytes'
        ``Linear4bit`` computes): float32 -> compute dtype -> ``dtype``; bitsandbytes' device
        kernel writes the first rounding's dtype directly."""
        w = _bnb_dequantize(self, dtype if self.compute_dtype == torch.float32 else self.compute_dtype)
        if w is None:
            w = dequantize(self.packed, self.absmax, self.nested_absmax, self.offset, self.shape, self.blocksize,
                           self.nested_blocksize)
        if w.dtype == torch.float32:
            w = w.to(self.compute_dtype)
        return w.to(dtype)

    def add_lora(self, r: int, scaling: float, dropout: float, values, enable=None) -> None:
        """Put a LoRA pair (numpy ``A`` (r, in), ``B`` (out, r)) on this layer; with ``enable``
        (per-slice flags of a fused projection, GPT-2's ``c_attn``) one pair per enabled slice
        in ``LoRAMergedLinear``'s layout: ``A`` (k*r, in), ``B`` (k*out/n, r)."""
        self.enable_lora = None if enable is None else tuple(enable)
        self.enabled = [i for i, on in enumerate(self.enable_lora or ()) if on]
        self.r, self.scaling, self.p = r, scaling, dropout
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Parameter(torch.from_numpy(np.ascontiguousarray(values[0], np.float32)))
        self.lora_B = nn.Parameter(torch.from_numpy(np.ascontiguousarray(values[1], np.float32)))

    def _slice_out(self) -> int:
        return self.out_features // len(self.enable_lora) if self.enable_lora else self.out_features

    def _lora_out(self, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        return (LoRAMergedLinear if self.enable_lora else LoRALinear)._lora_out(self, x, base)

    def delta_weight(self) -> torch.Tensor:
        return (LoRAMergedLinear if self.enable_lora else LoRALinear).delta_weight(self)

    def input_grad(self, g: torch.Tensor) -> torch.Tensor:
        """``g W`` of the dequantized base weight (``_Matmul4bit``'s backward)."""
        return _input_grad(self, g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.decode_weight is not None:  # inside model.decoding(): the weight unpacked once, LoRA merged
            return linear_decode(x, self.decode_weight, self.bias)
        cd = self.compute_dtype
        if cd != torch.float32 and _product_dtype(x) == torch.float32:
            # bitsandbytes' Linear4bit: input, weight and bias in the compute dtype, one product, the
            # result back in the input's dtype (LoRA stays in the input's, as peft adds it)
            bias = None if self.bias is None else self.bias.to(cd)
            y = F.linear(x.to(cd), self.dequantized(cd), bias).to(x.dtype)
        else:
            y = _Matmul4bit.apply(x, self)
            if self.bias is not None:
                y = y + self.bias
        if self.r:
            y = self._lora_out(x, y)
        return y

    def merge(self) -> None:
        raise NotImplementedError("a 4-bit base layer cannot hold a merged LoRA update; dequantize first")


def to_4bit(model: nn.Module, states: dict, qcfg) -> None:
    """Replace the modules named by ``states`` (canonical weight names) by 4-bit layers."""
    for name, st in states.items():
        parent, _, child = module_of(name).rpartition(".")
        owner = model.get_submodule(parent)
        old = getattr(owner, child)
        bias = old.bias if getattr(old, "bias", None) is not None else None
        setattr(owner, child, LoRALinear4bit(st, bias, qcfg.compute_dtype))


def empty_model(model_cls, cfg):
    """``model_cls(cfg)`` without committing weight memory: on the meta device for the Llama
    family (its ``load_weights`` then takes the checkpoint's memory-mapped float32 arrays as they
    are, so the unquantized weights, e.g. a 128k-row embedding, are never copied: the load's
    peak stays near the 4-bit model plus one tensor), else uninitialised pages."""
    from .llama import LlamaForCausalLM

    with torch.device("meta"):
        model = model_cls(cfg)
    return model if model_cls is LlamaForCausalLM else model.to_empty(device="cpu")


def from_pretrained_4bit(path, adapter=None, quantize=None, double_quant: bool | None = None,
                         compute_dtype: str | None = None, blocksize: int | None = None, explicit=None):
    """A QLoRA base (Llama family or GPT-2); see ``lora_core.quant.checkpoint4bit.build_4bit_model``."""
    from lora_core.quant.checkpoint4bit import build_4bit_model

    from .gpt2 import GPT2LMModel
    from .inject import load_lora_adapter
    from .llama import LlamaForCausalLM

    model = build_4bit_model({"llama": LlamaForCausalLM, "gpt2": GPT2LMModel}, empty_model, to_4bit, load_lora_adapter,
                             path, adapter, quantize, double_quant, compute_dtype, blocksize, explicit)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"{path}: parameters left without values after loading: {left[:5]}")
    return model


def save_quantized(model, folder) -> None:
    """Save a 4-bit model's base as a bitsandbytes checkpoint folder that transformers loads
    (``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")``); LoRA is not part of
    it (``save_lora_adapter``). See ``lora_core.quant.checkpoint4bit.save_4bit_model``."""
    from lora_core.quant.checkpoint4bit import save_4bit_model

    save_4bit_model(model, folder, LoRALinear4bit, _state_of)


def _state_of(m: LoRALinear4bit) -> NF4State:
    """The layer's NF4 state as numpy arrays, from whatever device it is on."""
    host = lambda t: t.detach().cpu().numpy()  # noqa: E731
    st = NF4State(host(m.packed), host(m.absmax), m.shape, m.blocksize, m.quant_dtype)
    if m.nested_absmax is not None:
        st.nested_absmax, st.offset = host(m.nested_absmax), np.float32(m.offset.item())
        st.nested_blocksize = m.nested_blocksize
    return st


__all__ = ["LoRALinear4bit", "dequantize", "empty_model", "from_pretrained_4bit", "save_quantized", "to_4bit"]
