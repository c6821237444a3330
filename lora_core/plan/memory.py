"""The memory planner: a training run's per-rank peak memory, predicted before the run, split into
weights, gradients, optimizer state, activations and framework overhead; and its FLOPs per token.

Sources: the ZeRO paper (Rajbhandari et al. 2020: K = 12 bytes of fp32 master weight and Adam
moments per mixed-precision parameter; stage 2 shards gradients and optimizer state, stage 3
the parameters too), Korthikanti et al. 2023 (activations as bytes per token per layer, saved
tensor by saved tensor), QLoRA (Dettmers et al. 2023: NF4 with double quantization), and
the autograd graphs of the models measured (``backends/torch/llama.py``,
``backends/jittor/llama.py``, transformers' ``modeling_llama.py`` + peft).

The model (``plan``; every term per rank, bytes; P: parameters, T: trainable ones)::

    weights     = (P - T) x frozen bytes (4 fp32 | 2 bf16 | 0.516 NF4 + double quant) + T x 4   (LoRA)
                  P x (4 | 2)                                                                (full)
                  / ranks at ZeRO-3, plus two gathered layers
    gradients   = T x (4 | 2 for bf16 full FT)                        / ranks at ZeRO >= 2
    optimizer   = T x (8 AdamW moments | 12 = moments + fp32 master for bf16 full FT) / ranks at ZeRO >= 2
    activations = act_scale x tokens x (saved x act bytes + head + transient)
        saved = layers x layer_saved            (no GC)
              | layers x hidden + layer_saved   (GC: each layer's input; one layer recomputed)
        head  = 4 x (hidden (x2 trained) + (3 + logits held) x vocab)  (loss in fp32: log-softmax
                output, then two (N, V) gradients)
        transient = (2 ffn + 2 hidden) x act bytes (one layer's backward)
    overhead    = base (framework imported) + extra + (ckpt_kept [+ qlora_kept]) x fp32 checkpoint bytes
    peak        = weights + optimizer + overhead + gradients + (overlap for full FT | 1) x activations

``overlap`` < 1: full FT's gradients are made while the backward pass frees activations, so
not all of both are alive at once. The per-system constants (``SYSTEMS``) were measured on the
methods bench (docs/planning.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MB = 2**20
METHODS = ("full", "lora", "qlora")
PRECISIONS = ("fp32", "bf16")
STAGES = (0, 2, 3)
LLAMA_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPT2_PROJ = ("c_attn", "attn.c_proj", "c_fc", "mlp.c_proj")
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit codes, an 8-bit absmax per 64, an fp32 scale per 256 blocks


@dataclass(frozen=True)
class System:
    """What a training system keeps beyond the model's tensors.

    ``base_mb``: private memory with the framework imported and no model (the bench's
    ``baseline_private_mb``); ``extra_mb``: a constant above it once a model trains (the
    autograd engine, thread pools, kernels' workspaces); ``ckpt_kept``: bytes kept per byte of
    the fp32 checkpoint (the loader's pages and copies the process still holds: a memory-mapped
    safetensors file's touched pages are private until unmapped); ``act_scale``: measured over
    counted activations (1: exactly the tensors of ``layer_saved`` and the head);
    ``overlap``: full FT, the share of the activations alive with all the gradients (freed as
    the backward pass makes gradients); ``qlora_kept``: bytes per fp32 checkpoint byte a 4-bit
    model keeps from loading (quantization reads the fp32 weights); ``silu_saved``,
    ``norm_saved``, ``attn_probs``: tensors SwiGLU keeps (ours-torch: gate and up, a custom
    function; transformers: gate, silu(gate), up; Jittor's lazy graph: its intermediates), per
    RMSNorm (hidden widths), and (heads x T) attention matrices per token (0: a fused SDPA)."""

    name: str
    base_mb: float
    extra_mb: float
    ckpt_kept: float = 0.0
    act_scale: float = 1.0
    overlap: float = 1.0
    qlora_kept: float = 0.0
    silu_saved: int = 2
    norm_saved: int = 1
    attn_probs: int = 0
    logits_alive: int = 0  # logits (N, V) held by the caller through the backward pass
    note: str = ""


# Measured on the CPU bench (docs/planning.md, docs/bench/lm_methods_*.json): base_mb is the
# bench's baseline_private_mb; extra_mb, ckpt_kept, act_scale, overlap and qlora_kept are a
# least-squares fit to its rows (two shapes, 12 rows per system; the fit is described in docs/planning.md).
SYSTEMS: dict[str, System] = {
    "ours-torch": System("ours-torch", 147.0, 132.9, 0.433, 0.517, 0.573, 0.646, 2, 1, 0, 0,
                         "PyTorch CPU, backends.torch"),
    "ours-jittor": System("ours-jittor", 20.0, 169.5, 0.224, 1.509, 0.850, 0.671, 4, 3, 2, 0,
                          "Jittor CPU, backends.jittor"),
    "hf-peft": System("hf-peft", 146.0, 177.4, 0.382, 0.966, 0.924, 1.015, 3, 1, 0, 1,
                      "transformers + peft, PyTorch CPU"),
    "gpu": System("gpu", 500.0, 0.0, 0.0, 1.1, 1.0, 0.0, 2, 1, 0, 0,
                  "assumed, unmeasured here: CUDA context ~500 MB, the caching allocator ~10% above the activations"),
}  # fmt: skip


@dataclass(frozen=True)
class Arch:
    """A decoder-only transformer reduced to what memory depends on (widths per token)."""

    kind: str  # llama | gpt2
    layers: int
    hidden: int
    q: int  # query width (heads x head_dim)
    kv: int  # key/value width
    ffn: int
    vocab: int
    heads: int
    tied: bool
    proj: dict[str, tuple[int, int]]  # per layer: name -> (in, out)
    other_params: int  # embeddings, norms, LM head (not per-layer projections)
    layer_small: int  # per layer: norms, biases


@dataclass(frozen=True)
class PlanConfig:
    """One run to plan. ``targets``: the adapted projections (LoRA, QLoRA); ``precision``:
    ``fp32`` or ``bf16`` (frozen weights and activations in bf16; full FT in mixed precision
    with fp32 master weights; LoRA's adapters and their moments in fp32, as peft keeps them)."""

    method: str = "lora"
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    r: int = 8
    precision: str = "fp32"
    gc: bool = False
    zero: int = 0
    ranks: int = 1
    batch: int = 2
    seq: int = 256
    system: str = "ours-torch"
    overhead_mb: float | None = None  # replaces the system's base_mb (a measured baseline)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method {self.method!r} is not one of {METHODS}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is not one of {PRECISIONS}")
        if self.zero not in STAGES:
            raise ValueError(f"ZeRO stage {self.zero!r} is not one of {STAGES}")
        if not isinstance(self.ranks, int) or self.ranks < 1:
            raise ValueError(f"ranks must be a positive int, got {self.ranks!r}")
        if self.zero and self.ranks < 2:
            raise ValueError(
                f"ZeRO stage {self.zero} with {self.ranks} rank shards nothing: use ranks >= 2 or --zero 0"
            )
        if self.system not in SYSTEMS:
            raise ValueError(f"system {self.system!r} is not one of {tuple(SYSTEMS)}")
        for name in ("r", "batch", "seq"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < (0 if name == "r" else 1):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.method != "full" and (not self.targets or self.r < 1):
            raise ValueError(f"{self.method} needs targets and r >= 1, got {self.targets!r}, r={self.r}")


@dataclass
class Plan:
    """A prediction (MB per rank): the peak and its parts (module docstring); ``per_layer``:
    one layer's saved activations by what keeps them."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    overhead: float
    peak: float = 0.0
    per_layer: dict[str, float] = field(default_factory=dict)
    per_layer_gc: float = 0.0
    per_layer_nogc: float = 0.0
    head: float = 0.0
    params: int = 0
    trainable: int = 0
    flops_per_token: float = 0.0
    flops_note: str = ""


def arch_of(cfg) -> Arch:
    """``Arch`` of a ``LlamaConfig`` or ``GPT2Config``; anything else: ``ValueError``."""
    from ..models.gpt2 import GPT2Config
    from ..models.llama import LlamaConfig

    if isinstance(cfg, LlamaConfig):
        E, q, kv, F = (
            cfg.hidden_size,
            cfg.num_attention_heads * cfg.head_dim,
            cfg.num_key_value_heads * cfg.head_dim,
            cfg.intermediate_size,
        )
        proj = {"q_proj": (E, q), "k_proj": (E, kv), "v_proj": (E, kv), "o_proj": (q, E),
                "gate_proj": (E, F), "up_proj": (E, F), "down_proj": (F, E)}  # fmt: skip
        bias = (q + 2 * kv) * cfg.qkv_bias + E * cfg.o_bias + (2 * F + E) * cfg.mlp_bias
        other = cfg.vocab_size * E * (1 if cfg.tie_word_embeddings else 2) + E
        return Arch("llama", cfg.num_hidden_layers, E, q, kv, F, cfg.vocab_size, cfg.num_attention_heads,
                    cfg.tie_word_embeddings, proj, other, 2 * E + bias)  # fmt: skip
    if isinstance(cfg, GPT2Config):
        E = cfg.n_embd
        proj = {"c_attn": (E, 3 * E), "attn.c_proj": (E, E), "c_fc": (E, 4 * E), "mlp.c_proj": (4 * E, E)}
        other = (cfg.vocab_size + cfg.n_positions) * E + 2 * E
        return Arch("gpt2", cfg.n_layer, E, E, E, 4 * E, cfg.vocab_size, cfg.n_head, True, proj, other, 4 * E + 9 * E)
    raise ValueError(f"the planner knows Llama-family and GPT-2 configs, not {type(cfg).__name__}")


def layer_saved(a: Arch, c: PlanConfig, sysm: System) -> dict[str, float]:
    """Elements per token one layer keeps for the backward pass, by what keeps them."""
    train = set(a.proj) if c.method == "full" else set(c.targets)
    unknown = train - set(a.proj)
    if unknown:
        raise ValueError(f"targets {sorted(unknown)} are not projections of a {a.kind} layer: {tuple(a.proj)}")
    out = {"norm inputs": 2 * sysm.norm_saved * a.hidden}
    if a.kind == "llama":
        attn_in, mlp_in = {"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}
        out["attention input (trainable q/k/v)"] = a.hidden if train & attn_in else 0
        out["q, k, v after RoPE (SDPA)"] = a.q + 2 * a.kv
        out["attention output (SDPA)"] = a.q
        out["attention probabilities (unfused)"] = sysm.attn_probs * a.heads * c.seq
        out["o_proj input"] = a.q if "o_proj" in train else 0
        out["MLP input (trainable gate/up)"] = a.hidden if train & mlp_in else 0
        out["SwiGLU (gate, up[, silu])"] = sysm.silu_saved * a.ffn
        out["down_proj input"] = a.ffn if "down_proj" in train else 0
    else:  # GPT-2: LayerNorm keeps its input; c_attn's input, q k v, the attention output, GELU's input
        out["c_attn input"] = a.hidden if "c_attn" in train else 0
        out["q, k, v (SDPA)"] = 3 * a.hidden
        out["attention output (SDPA)"] = a.hidden
        out["attn.c_proj input"] = a.hidden if "attn.c_proj" in train else 0
        out["c_fc input"] = a.hidden if "c_fc" in train else 0
        out["GELU input"] = a.ffn
        out["mlp.c_proj input"] = a.ffn if "mlp.c_proj" in train else 0
    if c.method != "full":
        out["LoRA A products"] = c.r * len(train)
    return out


def _params(a: Arch, c: PlanConfig) -> tuple[int, int, int]:
    """All parameters, the trainable ones, and the frozen ones a 4-bit base quantizes."""
    proj = sum(i * o for i, o in a.proj.values())
    total = a.other_params + a.layers * (proj + a.layer_small)
    if c.method == "full":
        return total, total, 0
    lora = a.layers * sum(c.r * (a.proj[t][0] + a.proj[t][1]) for t in c.targets)
    return total + lora, lora, a.layers * proj if c.method == "qlora" else 0


def plan(cfg, c: PlanConfig) -> Plan:
    """The per-rank peak of one training run (module docstring); ``cfg`` a model config."""
    a, sysm = arch_of(cfg), SYSTEMS[c.system]
    per_layer = layer_saved(a, c, sysm)  # refuses unknown targets first
    total, trainable, quantized = _params(a, c)
    bf16 = c.precision == "bf16"
    wb = 2 if bf16 else 4  # bytes of a weight as held (frozen; full FT's working copy)
    frozen = total - trainable
    if c.method == "full":
        weights, grad_b, opt_b = total * wb, wb, 8 + (4 if bf16 else 0)  # bf16: fp32 master in the optimizer
    else:  # adapters in fp32 (peft upcasts them), frozen base as held or 4-bit
        weights = (frozen - quantized) * wb + quantized * NF4_BYTES + trainable * 4
        grad_b, opt_b = 4, 8
    shard_go = c.ranks if c.zero >= 2 else 1
    gradients = trainable * grad_b / shard_go
    optimizer = trainable * opt_b / shard_go
    if c.zero == 3:  # sharded, and one layer gathered at a time
        layer_bytes = sum(i * o for i, o in a.proj.values()) * (NF4_BYTES if quantized else wb)
        # the layer computed and the next prefetched, whole (their own shard counted already)
        weights = weights / c.ranks + min(2, a.layers) * layer_bytes * (1 - 1 / c.ranks)
    ab = 2 if bf16 else 4
    tokens = c.batch * c.seq
    nogc = sum(per_layer.values())
    saved = a.layers * a.hidden + nogc if c.gc else a.layers * nogc  # GC: each layer's input, one layer recomputed
    # LM head and loss (fp32): the final norm's input (and the head's, trained), log-softmax's
    # output (+ the logits where the caller holds them), then two (N, V) gradients
    head = 4 * (a.hidden * (2 if c.method == "full" else 1) + (3 + sysm.logits_alive) * a.vocab)
    transient = (2 * a.ffn + 2 * a.hidden) * ab  # one layer's backward: its widest gradients
    quant_tmp = max(i * o for i, o in a.proj.values()) * 4 if quantized else 0  # one dequantized weight
    activations = sysm.act_scale * (tokens * (saved * ab + head + transient) + quant_tmp)
    base = (sysm.base_mb if c.overhead_mb is None else c.overhead_mb) * MB
    ckpt = 4 * (total - (trainable if c.method != "full" else 0))  # the checkpoint's fp32 bytes
    overhead = base + sysm.extra_mb * MB + (sysm.ckpt_kept + (sysm.qlora_kept if quantized else 0)) * ckpt
    # full FT frees activations as the backward pass makes gradients: a share overlaps them all
    dynamic = gradients + (sysm.overlap if c.method == "full" else 1.0) * activations
    peak = weights + optimizer + overhead + dynamic
    flops, note = flops_per_token(cfg, a, c, total, trainable)
    return Plan(weights / MB, gradients / MB, optimizer / MB, activations / MB, overhead / MB, peak / MB,
                {k: v * tokens * ab / MB for k, v in per_layer.items()},
                a.hidden * ab * tokens / MB, nogc * ab * tokens / MB, tokens * head / MB,
                total, trainable, flops, note)  # fmt: skip


def flops_per_token(cfg, a: Arch, c: PlanConfig, total: int, trainable: int) -> tuple[float, str]:
    """Training FLOPs per token: forward 2 per weight multiply-add (M) plus attention (A);
    the backward's input gradients another M + A, and weight gradients M only for trained
    weights (so full FT ~ 6N, LoRA ~ 4N: frozen weights get no weight gradient); GC adds
    one forward (2N) more."""
    M = 2 * sum(i * o for i, o in a.proj.values()) * a.layers + 2 * a.vocab * a.hidden
    A = a.layers * 2 * 2 * a.q * (c.seq + 1) / 2  # QK^T and AV, causal
    if c.method == "full":
        f, how = 3 * M + 3 * A, "full: 3 x (2 N_matmul) + 3 x attention ~ 6N"
    else:
        L = 2 * a.layers * sum(c.r * (a.proj[t][0] + a.proj[t][1]) for t in c.targets)
        f, how = (
            2 * M + 3 * A + 3 * L,
            "LoRA: 2 x (2 N_matmul) + 3 x attention + 3 x LoRA ~ 4N (no frozen weight gradients)",
        )
    if c.gc:
        f, how = f + M + A, how + "; GC: + one forward (2N) recomputed"
    return float(f), how


def fmt_plan(p: Plan, c: PlanConfig, name: str) -> str:
    """The plan as the console prints it."""
    sysm = SYSTEMS[c.system]
    lines = [f"model {name}: {p.params / 1e6:.1f} M parameters, {p.trainable / 1e6:.2f} M trainable "
             f"({c.method}{'' if c.method == 'full' else f' r={c.r} on ' + ','.join(c.targets)}), {c.precision}, "
             f"GC {'on' if c.gc else 'off'}, ZeRO-{c.zero} over {c.ranks} rank(s), micro-batch {c.batch} x {c.seq} tokens, "
             f"system {c.system} ({sysm.note})",
             f"{'per-rank peak':24s} {p.peak:10.1f} MB  ({p.peak / 1024:.2f} GiB)",
             f"  {'weights':22s} {p.weights:10.1f} MB",
             f"  {'gradients':22s} {p.gradients:10.1f} MB",
             f"  {'optimizer state':22s} {p.optimizer:10.1f} MB",
             f"  {'activations':22s} {p.activations:10.1f} MB",
             f"  {'framework overhead':22s} {p.overhead:10.1f} MB",
             f"activations of one layer: {p.per_layer_nogc:.1f} MB without GC, {p.per_layer_gc:.1f} MB with GC "
             f"(its input); LM head and loss {p.head:.1f} MB"]  # fmt: skip
    lines += [f"    {k:36s} {v:8.1f} MB" for k, v in p.per_layer.items() if v]
    lines.append(
        f"FLOPs per token {p.flops_per_token / 1e9:.3f} GFLOP ({p.flops_per_token / p.params:.2f} x N): {p.flops_note}"
    )
    return "\n".join(lines)


def resolve_model(spec: str):
    """``(config, name)`` from a ``config.json`` path (or its folder) of GPT-2 or the Llama
    family, or a preset name (Llama presets, then GPT-2's); else ``ValueError``."""
    from pathlib import Path

    from ..formats.tensor_files import read_json
    from ..models import gpt2, llama

    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        kind = read_json(path).get("model_type")
        if kind == "gpt2":
            return gpt2.GPT2Config.from_hf_json(str(path)), str(path)
        if kind in llama.MODEL_TYPES:
            return llama.LlamaConfig.from_hf_json(path), str(path)
        raise ValueError(
            f"{path}: model_type {kind!r} is unknown to the planner; it knows gpt2 and {llama.MODEL_TYPES}"
        )
    if spec in llama.PRESETS:
        return llama.PRESETS[spec], spec
    if spec in gpt2.PRESETS:
        return gpt2.PRESETS[spec], spec
    raise ValueError(f"{spec!r} is neither a config.json nor a preset ({sorted(llama.PRESETS) + sorted(gpt2.PRESETS)})")


BENCH_TARGETS, BENCH_R = ("q_proj", "k_proj", "v_proj", "o_proj"), 8  # examples.lm.bench_systems


def bench_plan(shape: str, layers: int | None, batch: int, block: int, system: str, method: str) -> Plan:
    """The plan of one row of ``examples.lm.bench --methods`` (method ``full``, ``lora-gc``, ...)."""
    from ..models.llama import llama_config

    cfg = llama_config(shape, **({"num_hidden_layers": layers} if layers else {}))
    c = PlanConfig(method=method.removesuffix("-gc"), targets=BENCH_TARGETS, r=BENCH_R, gc=method.endswith("-gc"),
                   batch=batch, seq=block, system=system)  # fmt: skip
    return plan(cfg, c)
