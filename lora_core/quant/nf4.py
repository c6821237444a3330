"""NF4 (4-bit NormalFloat) blockwise quantization with double quantization of the block
scales, byte for byte as bitsandbytes 0.50.2 on CPU (``bitsandbytes.functional.quantize_4bit``
/ ``dequantize_4bit`` with ``quant_type="nf4"``, ``compress_statistics=True``).

Sources: Dettmers et al. 2023, QLoRA (NF4, double quantization); Dettmers et al. 2022, 8-bit
optimizers (the blockwise dynamic 8-bit map used for the block scales); bitsandbytes'
``functional.py`` and its CPU kernels (read, not copied).

The layout (what ``NF4State`` holds, shapes for a weight of ``n`` elements, blocksize ``b``):
    ``packed``  (ceil(n / 2), 1) uint8: two codes per byte, element ``2i`` in the high nibble,
                ``2i + 1`` in the low one; an odd ``n`` pads one zero (code 7).
    ``absmax``  (ceil(n / b),) float32 per-block absolute maxima, or, with double
                quantization, (ceil(n / b),) uint8 codes into ``nested_code``;
    ``nested_absmax`` (ceil(n / b / 256),) float32, ``offset`` float32 (mean of the absmax
                values, subtracted before their 8-bit quantization).
Rounding rules (they decide the bytes):
    4-bit: ``x * (1 / max(absmax, 1e-38))`` (a division for the last, partial block, whose
    stored absmax is the clamped one), clipped to [-1, 1], then the code whose midpoint
    interval holds it; a value on a midpoint takes the lower code.
    8-bit scales: ``(absmax - offset) * (1 / nested_absmax)``, placed by bitsandbytes' CPU
    lookup table (``_lut_search``: not always the nearest code near a midpoint).
    offset: torch's float32 CPU ``mean`` (its cascade sum: 4 x ``lanes`` partial sums,
    then ``/ n``), which ``_torch_sum`` reproduces.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

# bitsandbytes' NF4 table (get_4bit_type("nf4")): quantiles of N(0, 1) scaled to [-1, 1].
NF4_CODE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0], dtype=np.float32)
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # what bitsandbytes' quantize_4bit accepts
NESTED_BLOCKSIZE = 256  # the block scales' own block size (quantize_4bit's compress_statistics)
_TINY = np.float32(1e-38)  # the smallest absmax quantize_4bit divides by
_GRAIN = 32768  # torch's internal GRAIN_SIZE: reductions below it run on one thread
# elements quantized at a time, over all workers together: the float32 piece, its scaled copy
# and its uint8 codes take ~10-14 B per element, so a tensor's working memory is ~12 MB, not ~4x the
# tensor (measured: a 100 MB float32 MLP weight of Llama-3.2-3B left ~390 MB of temporaries
# quantized whole)
QUANT_PIECE = 1 << 20
# threads quantizing a tensor's pieces at once (numpy's loops release the GIL), each on
# QUANT_PIECE / workers elements, so that the working memory stays that of one piece:
# LORA_QUANT_WORKERS, else half the CPUs this process may run on (the other half left to the
# framework's own threads), at most MAX_WORKERS. One 8192 x 2048 weight: 87 ms on 1 thread,
# 59 ms on 2 (2 cores); inside the torch loader on 2 cores, 2 threads were no faster than 1
WORKERS_ENV = "LORA_QUANT_WORKERS"
MAX_WORKERS = 8


def positive_env(name: str, value: str, what: str) -> int:
    """``value`` (the text of the variable ``name``) as a positive integer: ASCII decimal digits
    only, so that ``int()`` never meets what it rejects (``str.isdigit`` accepts '²'); another
    value is refused naming the variable, the value and ``what`` it counts."""
    v = value.strip()
    if not (v.isascii() and v.isdecimal()) or int(v) < 1:
        raise ValueError(f"{name}={value!r}: expected a positive integer ({what})")
    return int(v)


def quant_workers() -> int:
    """Threads for :func:`quantize_nf4` (``WORKERS_ENV``, else half this process's CPUs, at
    most ``MAX_WORKERS``); a value that is not a positive integer is refused by name."""
    env = os.environ.get(WORKERS_ENV, "").strip()
    if env:
        return positive_env(WORKERS_ENV, env, "threads quantizing a tensor")
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cpus // 2))


def check_blocksize(blocksize: int, where: str = "blocksize") -> int:
    """``blocksize`` if bitsandbytes allows it for 4-bit quantization, else ValueError."""
    if isinstance(blocksize, bool) or not isinstance(blocksize, (int, np.integer)) or int(blocksize) not in BLOCKSIZES:
        raise ValueError(f"{where} {blocksize!r} is not a 4-bit block size bitsandbytes allows; choose from {BLOCKSIZES}")
    return int(blocksize)


def _linspace_f32(start: float, end: float, steps: int) -> np.ndarray:
    """torch.linspace in float32 on CPU: ``start + step * i`` up to half way, ``end - step *
    (steps - 1 - i)`` after, ``step`` rounded to float32 first and each value rounded once
    (torch's kernel is compiled to fused multiply-adds; float64 holds both exactly here)."""
    s, e = np.float32(start), np.float32(end)
    step = np.float64(np.float32((e - s) / np.float32(steps - 1)))
    i = np.arange(steps, dtype=np.float64)
    lo = np.float64(s) + step * i
    hi = np.float64(e) - step * (steps - 1 - i)
    return np.where(i < steps // 2, lo, hi).astype(np.float32)


def dynamic_map() -> np.ndarray:
    """bitsandbytes' signed 8-bit dynamic map (``create_dynamic_map()``: 7 exponent levels,
    the fraction in linearly spaced bins' means), 256 sorted float32 values."""
    data = []
    for i in range(7):
        b = _linspace_f32(0.1, 1.0, 2 ** i + 1)
        means = (b[:-1] + b[1:]) / np.float32(2)
        scale = np.float32(10.0 ** (-6 + i))
        data += list(means * scale) + list(means * -scale)
    data += [np.float32(0), np.float32(1)]
    return np.sort(np.array(data, dtype=np.float32))


LANES_ENV = "LORA_CORE_TORCH_SUM_LANES"


def cpu_lanes() -> int:
    """float32 lanes of torch's CPU vector sum: 8 (measured with torch 2.13 on AVX-512 and
    AVX2 machines alike); ``LORA_CORE_TORCH_SUM_LANES`` overrides: a positive integer (any: the
    sum splits a vector into ``size // lanes`` rows of ``lanes`` and adds the rest one by one, so
    it need divide nothing; it matches bitsandbytes' offset only at torch's own width, 8 where
    measured). Another value is refused naming the variable."""
    env = os.environ.get(LANES_ENV, "").strip()
    if not env:
        return 8
    return positive_env(LANES_ENV, env, "float32 lanes of torch's CPU vector sum, 8 where measured; "
                                             "it need not divide the tensor's size")


def _rows_sum(rows: np.ndarray) -> np.ndarray:
    """torch's ``multi_row_sum`` over axis 0 (four cascade levels), float32."""
    size = rows.shape[0]
    power = max(4, (int(size - 1).bit_length() if size > 2 else 1) // 4)
    step, mask = 1 << power, (1 << power) - 1
    acc = np.zeros((4,) + rows.shape[1:], np.float32)
    i = 0
    while i + step <= size:
        for j in range(step):
            acc[0] += rows[i + j]
        i += step
        for lvl in range(1, 4):
            acc[lvl] += acc[lvl - 1]
            acc[lvl - 1] = 0
            if i & (mask << (lvl * power)):
                break
    for j in range(i, size):
        acc[0] += rows[j]
    for lvl in range(1, 4):
        acc[0] += acc[lvl]
    return acc[0]


def _row_sum(x: np.ndarray) -> np.ndarray:
    """torch's ``row_sum``: 4 interleaved accumulators (rows of 4 items) then their sum."""
    n4 = x.shape[0] // 4
    part = _rows_sum(x[:n4 * 4].reshape((n4, 4) + x.shape[1:])) if n4 else \
        np.zeros((4,) + x.shape[1:], np.float32)
    for j in range(n4 * 4, x.shape[0]):
        part[0] += x[j]
    for k in range(1, 4):
        part[0] += part[k]
    return part[0]


def _serial_sum(x: np.ndarray, lanes: int) -> np.float32:
    if x.size < lanes:  # torch's scalar inner sum
        return np.float32(_row_sum(x))
    nv = x.size // lanes
    vec = _row_sum(x[:nv * lanes].reshape(nv, lanes))  # (lanes,)
    acc = np.float32(0)
    for v in x[nv * lanes:]:
        acc = np.float32(acc + v)
    for v in vec:
        acc = np.float32(acc + v)
    return acc


def _torch_sum(x: np.ndarray, lanes: int | None = None, threads: int = 1) -> np.float32:
    """``torch.sum`` of a contiguous float32 vector on CPU, bit for bit: one thread below
    32768 items (or with ``threads=1``), else ``threads`` equal chunks and a sum of theirs."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    lanes = lanes or cpu_lanes()
    if x.size < _GRAIN or threads <= 1:
        return np.float32(np.float32(0) + _serial_sum(x, lanes))
    used = min(threads, -(-x.size // _GRAIN))
    chunk = -(-x.size // used)
    parts = np.zeros(threads, np.float32)
    for t in range(used):
        parts[t] = _serial_sum(x[t * chunk:(t + 1) * chunk], lanes)
    return np.float32(np.float32(0) + _serial_sum(parts, lanes))


THREADS_ENV = "LORA_CORE_TORCH_THREADS"


def absmax_offset(absmax: np.ndarray, threads: int | None = None) -> np.float32:
    """The double-quantization offset: torch's float32 ``absmax.mean()`` on CPU. ``threads``:
    torch's intra-op threads (``torch.get_num_threads()``) in the process where bitsandbytes
    quantized; default ``LORA_CORE_TORCH_THREADS``, else 1. It matters from 32768 blocks up
    (2,097,152 elements at blocksize 64: Llama-3.2-1B's q_proj has 65536 blocks), where torch sums
    ``min(threads, ceil(blocks / 32768))`` chunks apart: bitsandbytes run under another thread
    count can store another offset (its last bit) and so other 8-bit scale codes, its 4-bit codes
    the same. 1 keeps the bytes the same on every machine and in both backends (this package
    imports no torch here and is not told the caller's threads); set the variable to the
    bitsandbytes process's ``torch.get_num_threads()`` for its bytes (a 4096 x 2048 weight,
    bitsandbytes under 8 or 16 threads: other scale codes with 1, the same bytes with the
    variable set to 8 or 16)."""
    if not threads:
        env = os.environ.get(THREADS_ENV, "1").strip() or "1"
        threads = positive_env(THREADS_ENV, env, "torch's intra-op threads when bitsandbytes quantized")
    return np.float32(_torch_sum(absmax, threads=threads) / np.float32(absmax.size))


@dataclass
class NF4State:
    """One NF4-quantized tensor (see the module docstring for the layout)."""

    packed: np.ndarray
    absmax: np.ndarray
    shape: tuple[int, ...]
    blocksize: int = 64
    dtype: str = "float32"  # the quantized tensor's dtype (bitsandbytes' QuantState.dtype)
    nested_absmax: np.ndarray | None = None
    offset: np.float32 | None = None
    nested_blocksize: int = NESTED_BLOCKSIZE

    @property
    def nested(self) -> bool:
        return self.nested_absmax is not None

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def nbytes(self) -> int:
        extra = 0 if not self.nested else self.nested_absmax.nbytes + 4
        return self.packed.nbytes + self.absmax.nbytes + extra


def _absmax_blocks(flat: np.ndarray, blocksize: int) -> tuple[np.ndarray, np.ndarray]:
    """Scaled values in [-1, 1] and the per-block absmax, as quantize_4bit computes them."""
    n = flat.size
    full = n - n % blocksize
    blocks = flat[:full].reshape(-1, blocksize)
    absmax = np.abs(blocks).max(axis=1) if full else np.zeros(0, np.float32)
    inv = np.float32(1) / np.maximum(absmax, _TINY)
    scaled = [np.clip(blocks * inv[:, None], -1, 1).reshape(-1)]
    if n > full:
        am = np.maximum(np.abs(flat[full:]).max(), _TINY)
        absmax = np.concatenate([absmax, [am]])
        scaled.append(np.clip(flat[full:] / am, -1, 1))
    return np.concatenate(scaled).astype(np.float32), absmax.astype(np.float32)


def _nf4_codes(scaled: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """The NF4 code of each scaled value: how many of the 15 midpoints ``bounds`` lie below it
    (``np.searchsorted(bounds, scaled, side="left")``, NaN last: code 15), as 15 comparisons
    summed into uint8: 4 ms per million values here against searchsorted's 23 ms."""
    codes = np.zeros(scaled.shape, np.uint8)
    for b in bounds:
        codes += scaled > b
    codes[np.isnan(scaled)] = 15
    return codes


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """(n,) codes 0..15 -> (ceil(n / 2), 1) uint8, element 2i in the high nibble."""
    c = codes.astype(np.uint8)
    if c.size % 2:
        c = np.concatenate([c, np.array([7], np.uint8)])
    return ((c[0::2] << 4) | c[1::2]).reshape(-1, 1)


def unpack_nibbles(packed: np.ndarray, n: int) -> np.ndarray:
    """Inverse of ``pack_nibbles``: the first ``n`` codes."""
    p = np.asarray(packed, np.uint8).reshape(-1)
    return np.stack([p >> 4, p & 15], axis=1).reshape(-1)[:n]


def quantize_blockwise(x: np.ndarray, code: np.ndarray, blocksize: int = NESTED_BLOCKSIZE):
    """bitsandbytes' 8-bit blockwise quantization on CPU: ``(codes uint8, absmax float32)``;
    each value times its block's 1 / absmax is placed by ``_lut_search``."""
    x = np.asarray(x, np.float32).reshape(-1)
    n = x.size
    nb = -(-n // blocksize)
    pad = np.zeros(nb * blocksize, np.float32)
    pad[:n] = x
    # bitsandbytes' C loop keeps the larger of the running max and |x|, so a NaN never wins (fmax)
    absmax = np.fmax.reduce(np.abs(pad.reshape(nb, blocksize)), axis=1, initial=0).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        inv = (np.float32(1) / absmax).astype(np.float32)
        normed = np.clip((x * np.repeat(inv, blocksize)[:n]).astype(np.float32), -1, 1)
    out = _lut_search(normed, code)
    bad = ~np.isfinite(normed)  # 0/0 in an all-zero block
    out[bad] = _dynamic_search(normed[bad], code)
    return out, absmax


def _lut_search(v: np.ndarray, code: np.ndarray) -> np.ndarray:
    """bitsandbytes 0.50.2's CPU 8-bit search (``quantize_cpu`` in libbitsandbytes_cpu, read off
    its machine code): ``v = x * (1 / absmax)`` clamped to [-1, 1], then a 65536-entry table
    indexed by ``trunc(fma((1 + v) * 0.5, 65535, 0.5))`` (the fused result rounded to float32),
    entry ``k`` holding the number of the map's midpoints ``(c[i] + c[i+1]) * 0.5`` below
    ``2k / 65535 - 1`` (each step in float32). Values within half a table step (1.5e-5) of a
    midpoint can land on the farther code: that is what it stores, so the spec does too."""
    f32 = np.float32
    mids = ((code[:-1] + code[1:]) * f32(0.5)).astype(f32)
    k = np.arange(65536).astype(f32)
    table = np.searchsorted(mids, ((k + k) / f32(65535)).astype(f32) - f32(1), side="left").astype(np.uint8)
    t = ((f32(1) + np.nan_to_num(v)) * f32(0.5)).astype(f32)
    idx = np.floor((t.astype(np.float64) * 65535.0 + 0.5).astype(f32)).astype(np.int64)  # exact product, one rounding
    return table[idx]


def _dynamic_search(x: np.ndarray, code: np.ndarray) -> np.ndarray:
    """bitsandbytes' ``dQuantize`` (its CUDA kernel's rule, which its CPU kernel follows): a
    7-step bisection from entry 127 (steps 64 .. 1), then the entry on the value's side of the
    midpoint between the last pivot and its bracketing neighbour. It is not always the nearest
    entry, and NaN (0/0 in an all-equal block) lands on 0."""
    pivot = np.full(x.shape, 127, np.int64)
    upper_p, lower_p = np.full(x.shape, 255, np.int64), np.zeros(x.shape, np.int64)
    upper, lower = np.full(x.shape, 1.0, np.float32), np.full(x.shape, -1.0, np.float32)
    val = code[pivot]
    step = 64
    while step > 0:
        gt = x > val
        lower_p, lower = np.where(gt, pivot, lower_p), np.where(gt, val, lower)
        upper_p, upper = np.where(gt, upper_p, pivot), np.where(gt, upper, val)
        pivot = pivot + np.where(gt, step, -step)
        val = code[pivot]
        step //= 2
    upper = np.where(upper_p == 255, code[255], upper)
    lower = np.where(lower_p == 0, code[0], lower)
    gt = x > val
    up_mid = ((upper + val) * np.float32(0.5)).astype(np.float32)
    lo_mid = ((lower + val) * np.float32(0.5)).astype(np.float32)
    out = np.where(gt, np.where(x > up_mid, upper_p, pivot), np.where(x < lo_mid, lower_p, pivot))
    return out.astype(np.uint8)


def quantize_nf4(w: np.ndarray, blocksize: int = 64, double_quant: bool = True, dtype: str | None = None,
                 threads: int | None = None, workers: int | None = None) -> NF4State:
    """NF4-quantize ``w`` (any shape; float32, float16 or bfloat16 values given as float32).

    Args:
        w: the weight (numpy; a memory map is read once).
        blocksize: elements per absmax block (``BLOCKSIZES``).
        double_quant: quantize the absmax values to 8 bits (blocks of 256, minus their mean).
        dtype: the dtype name recorded in the state (default: ``w``'s, float32 for bfloat16
            arrays given as float32 unless named).
        threads: see ``absmax_offset``.
        workers: threads quantizing the pieces (default :func:`quant_workers`); the result
            does not depend on it.
    """
    blocksize = check_blocksize(blocksize)
    arr = np.asarray(w)
    name = dtype or ("float32" if arr.dtype.kind != "f" or arr.dtype.itemsize == 4 else str(arr.dtype))
    flat = arr.reshape(-1)  # a view of a contiguous array (a memory map stays one)
    n = flat.size
    absmax = np.empty(-(-n // blocksize), np.float32)
    packed = np.empty(((n + 1) // 2, 1), np.uint8)
    bounds = ((NF4_CODE[:-1] + NF4_CODE[1:]) / np.float32(2)).astype(np.float32)
    workers = workers or quant_workers()
    step = max(1, QUANT_PIECE // workers // blocksize) * blocksize  # whole blocks (an even count: whole bytes)

    def piece(a: int, values: np.ndarray) -> None:  # blockwise: the same values as the whole tensor at once
        scaled, am = _absmax_blocks(values, blocksize)
        absmax[a // blocksize : a // blocksize + am.size] = am
        codes = pack_nibbles(_nf4_codes(scaled, bounds))
        packed[a // 2 : a // 2 + codes.shape[0]] = codes

    starts = range(0, n, step)
    if workers == 1 or len(starts) == 1:
        for a in starts:
            piece(a, np.asarray(flat[a : a + step], dtype=np.float32))
    else:
        # each piece read (copied) here, quantized by a worker, at most ``workers`` at a time: the
        # page faults of a memory-mapped checkpoint taken in one thread (taken by the workers
        # themselves, the mapping's lock made 2 threads slower than 1 on llama-bench's loading)
        with ThreadPoolExecutor(min(workers, len(starts))) as pool:
            running = deque()
            for a in starts:
                running.append(pool.submit(piece, a, np.array(flat[a : a + step], dtype=np.float32)))
                if len(running) >= workers:
                    running.popleft().result()  # a piece's exception raised here
            for f in running:
                f.result()
    state = NF4State(packed, absmax, tuple(arr.shape), blocksize, name)
    if double_quant:
        offset = absmax_offset(absmax, threads)
        state.absmax, state.nested_absmax = quantize_blockwise((absmax - offset).astype(np.float32), dynamic_map())
        state.offset = offset
    return state


def block_scales(state: NF4State) -> np.ndarray:
    """The float32 absmax per block (the nested ones dequantized: ``code[q] * nested + offset``)."""
    if not state.nested:
        return np.asarray(state.absmax, np.float32)
    nb = np.repeat(np.asarray(state.nested_absmax, np.float32), state.nested_blocksize)[:state.absmax.size]
    return (dynamic_map()[state.absmax] * nb + np.float32(state.offset)).astype(np.float32)


def dequantize_nf4(state: NF4State, out_dtype=np.float32) -> np.ndarray:
    """The dequantized weight, ``NF4_CODE[code] * absmax`` in float32, in ``state.shape``
    (``out_dtype`` float32; a bfloat16 result is its round-to-nearest-even, ``to_bfloat16``)."""
    n = state.numel
    vals = NF4_CODE[unpack_nibbles(state.packed, n)]
    scale = np.repeat(block_scales(state), state.blocksize)[:n]
    out = (vals * scale).astype(np.float32).reshape(state.shape)
    return out if out_dtype in (np.float32, "float32") else to_bfloat16(out)


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> the float32 values of their bfloat16 rounding (nearest, ties to even)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) & np.uint32(0xFFFF0000)).astype(np.uint32)
    return np.where(np.isnan(x), x, r.view(np.float32))


__all__ = ["BLOCKSIZES", "NESTED_BLOCKSIZE", "NF4State", "NF4_CODE", "absmax_offset", "block_scales",
           "LANES_ENV", "THREADS_ENV", "check_blocksize", "cpu_lanes", "dequantize_nf4", "dynamic_map", "pack_nibbles", "quantize_blockwise",
           "quantize_nf4", "to_bfloat16", "unpack_nibbles"]
