"""The memory planner: a training run's per-rank peak memory, predicted before the run, split into
weights, gradients, optimizer state, activations, allocator retention and framework overhead;
and its FLOPs per token.

Sources: the ZeRO paper (Rajbhandari et al. 2020: K = 12 bytes of fp32 master weight and Adam
moments per mixed-precision parameter; stage 2 shards gradients and optimizer state, stage 3
the parameters too), Korthikanti et al. 2023 (activations as bytes per token per layer, saved
tensor by saved tensor), QLoRA (Dettmers et al. 2023: NF4 with double quantization), the
autograd graphs of the models measured (``backends/torch/llama.py``, ``backends/jittor/llama.py``,
transformers' ``modeling_llama.py`` + peft), and glibc malloc (``mallopt(3)``: blocks at or
above the mmap threshold, which grows up to 32 MB, are unmapped when freed; smaller ones stay
in the heap).

What is predicted is the run's own memory: on CPU the peak *anonymous* memory, not RSS: the
pages of a memory-mapped checkpoint that backs frozen weights are file pages, shared with the
page cache and dropped under pressure (``mapped`` reports them apart). The model (``plan``;
per rank, bytes; P parameters, T trainable ones, N = micro-batch x sequence tokens)::

    weights     = full FT: P x (4 | 2): the optimizer writes every weight (copy-on-write pages
                  of a mapped checkpoint become the process's own);
                  LoRA: T x 4 + 4-bit codes (0.516 bytes per quantized weight) + the frozen
                  weights the system copies (4 | 2 bytes; none for ``mapped_kinds``)
                  ZeRO-2 on FSDP2: + the trained weights / ranks (each a shard, gathered whole
                  from the forward to the end of the backward);
                  (DeepSpeed's stage 2 keeps them whole, unsharded: no extra);
                  ZeRO-3: the 4-bit codes whole (DeepSpeed: sharded), every other weight / ranks
                  (a shard copied into the process's own memory: nothing stays mapped), plus
                  gathered: FSDP2: two layers and the root unit (embeddings, final norm, head),
                  each held twice (all-gather output, parameters copied out); DeepSpeed: two
                  layers and one (V, E) table, x (1 - 1/ranks)
    gradients   = T x (4 | 2 for bf16 full FT)     / ranks at ZeRO >= 2 (FSDP2; Jittor's MPI: whole)
                  + full FT on FSDP2: 2 x the root unit's (its whole gradients, the reduce-scatter input)
    optimizer   = T x (8 AdamW moments | 12 = moments + fp32 master for bf16 full FT) / ranks at ZeRO >= 2
    activations = LoRA: act_scale x (N x (saved x act bytes + head + transient) + one dequantized weight)
                        (ours-torch: no whole dequantized weight; its kept buffer, ``deq_buffer_mb``)
                        + deq_kept x every quantized weight in fp32 (a lazy graph that keeps them)
                  full FT: emb_copies x the embedding table (the lookup's backward makes dense
                        (V, E) gradients while every other gradient exists; the activations
                        are freed by then)
        saved = layers x layer_saved | layers x hidden + layer_saved (GC)
        head  = 4 x (hidden (x2 trained) + head_nv x vocab): the (N, V) tensors at the head's backward
                (log-softmax output and two gradients; transformers' caller also holds the logits;
                ours-torch with a frozen head: head_nv_frozen = 1, the logits, turned into their
                gradient inside the loss's forward pass, none kept for the backward one)
        transient = (5 ffn + 2 hidden) x act bytes (SwiGLU's backward: incoming gradient, sigmoid,
                    products, both input gradients; the residual stream's two)
    retained    = heap x (one layer's forward allocations + the head's four (N, V) tensors (one
                  with ours-torch's frozen head) + QLoRA: one layer's weights dequantized twice
                  (forward and backward; none with a kept buffer))
                  + heap_layers x layers x one layer's forward allocations (the heap grows by layer)
                  + full FT: full_heap x the counted activations
                  each tensor counted only below the system's ``heap_ceiling_mb`` (glibc: the
                  freed heap is kept, what was mmapped is returned)
    overhead    = base (framework imported) + load (the model's code: backend, transformers,
                  peft) [+ load_4bit]
    peak        = weights + gradients + optimizer + activations + retained + overhead

``SYSTEMS`` holds per system what was measured (``base_mb``, ``load_mb``; torch's ``act_scale``
with glibc's heap retention turned off), counted (``emb_copies``, the tensors of ``layer_saved``)
or fitted on the methods bench (``validate.FITTED``): docs/planning.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..train.allocator import MODES as ALLOCATOR_MODES
from ..train.allocator import wanted as under_tcmalloc
from ..train.heap import HEAD_FUSED_MIN_BYTES, HEAD_PIECE_RULE, HEAD_PIECE_RULES, TRIM_MODES, head_piece_rows, run_trims
from ..train.recompute import mlp_chunk_rows

MB = 2**20
METHODS = ("full", "lora", "qlora")
PRECISIONS = ("fp32", "bf16")
STAGES = (0, 2, 3)
ZERO_ENGINES = ("fsdp2", "deepspeed", "mpi")
LLAMA_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPT2_PROJ = ("c_attn", "attn.c_proj", "c_fc", "mlp.c_proj")
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit codes, an 8-bit absmax per 64, an fp32 scale per 256 blocks
GLIBC_MMAP_MAX_MB = 32.0  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the dynamic threshold's ceiling


@dataclass(frozen=True)
class System:
    """What a training system holds beyond the model's tensors (module docstring).

    Measured: ``base_mb``, anonymous memory with the framework imported and no model (the
    bench's ``baseline_anon_mb``); ``load_mb`` (``load_4bit_mb``), what building a model adds
    on a model of negligible size (the backend's or transformers' and peft's modules; the
    4-bit path's): tiny-llama's rows. Physical: ``mapped_kinds``, the model kinds whose frozen
    fp32 weights stay the checkpoint's memory-mapped file pages (ours-torch's Llama loader;
    transformers' safetensors loading; ours-torch's GPT-2 loader copies them, transposed);
    ``emb_copies``, dense (V, E) buffers the embedding's backward makes at the end of the
    backward pass (2 in torch, read off a trace); ``heap_ceiling_mb``, tensors at or above it
    are returned to the OS when freed (glibc's 32 MB; None: the allocator caches every size);
    ``silu_saved``, ``norm_saved``, ``attn_probs``, ``head_nv``, ``lora_outs``: tensors SwiGLU
    keeps (ours-torch: gate and up, a custom function; transformers: gate, silu(gate), up;
    Jittor's lazy graph: its intermediates), per RMSNorm (hidden widths), (heads x T) attention
    matrices per token (0: a fused SDPA), (N, V) tensors alive at the head's backward (torch:
    log-softmax's output and two gradients; transformers' caller holds the logits too; Jittor:
    1, its fused graph, chosen among the counts 1-3 by the bench) and output-wide tensors per
    LoRA projection. Fitted on the methods bench (``validate.FITTED``): ``act_scale`` (live
    activations over counted; first measured for the torch systems with glibc's mmap threshold
    fixed at 128 kB, so that freed memory is returned, fitted since), ``heap`` and ``heap_layers`` (retained
    bytes per byte of one layer's heap allocations, once and per layer), ``full_heap`` (full FT:
    retained share of the activations), ``deq_kept_gc`` (Jittor QLoRA with GC: dequantized
    weights kept; ``deq_kept`` without GC: 1, every one, as its lazy graph holds them)."""

    name: str
    base_mb: float
    load_mb: float
    load_4bit_mb: float = 0.0
    mapped_kinds: tuple[str, ...] = ()
    act_scale: float = 1.0
    heap: float = 0.0
    heap_layers: float = 0.0
    full_heap: float = 1.0
    emb_copies: float = 2.0
    deq_kept: float = 0.0
    deq_kept_gc: float = 0.0
    heap_ceiling_mb: float | None = GLIBC_MMAP_MAX_MB
    silu_saved: int = 2
    norm_saved: int = 1
    attn_probs: int = 0
    head_nv: int = 3
    head_nv_frozen: int | None = None  # (N, V) tensors with a frozen head (LoRA, QLoRA); None: head_nv
    deq_buffer_mb: float | None = None  # QLoRA: one kept buffer each product dequantizes into, in row pieces
    lora_outs: int = 1  # output-wide tensors a LoRA layer's forward allocates (1: ours-torch's fused addmm)
    gelu_saved: int = 1  # GPT-2: MLP-wide tensors GELU keeps (1: its input, a fused or custom backward)
    gelu_allocs: int = 1  # GPT-2: MLP-wide tensors GELU's forward allocates
    # ZeRO's engine: "fsdp2" (PyTorch FSDP2: grads and moments sharded, at stage 2 the trained weights
    # too, gathered through the step; stage 3 every weight), "deepspeed" (stage 2 keeps the weights
    # whole), "mpi" (Jittor's: the AdamW moments only; no stage 3)
    zero_engine: str = "fsdp2"
    # every engine its runs shard ZeRO on, ``zero_engine`` (the default) first; empty: that one alone
    # (``PlanConfig.zero_engine`` picks another: transformers + peft on DeepSpeed)
    zero_engines: tuple[str, ...] = ()
    # the MPI engine (Jittor's, under mpirun with more than one rank): the model built holds this much
    # more (negative: less) than in one process (measured, not isolated), and its ZeRO-2 step holds
    # this many copies of the largest trained tensor at once (backends/jittor/distributed.py: the
    # zero-padded numpy buffer, its jittor copy, the all-reduce's output)
    mpi_load_delta_mb: float = 0.0
    zero_step_copies: int = 0
    # data parallelism without ZeRO over more than one rank (torch's DistributedDataParallel): the
    # gradient-sized copies DDP's flat buckets add beside the parameters' gradients (1: its default,
    # gradient_as_bucket_view=False, as transformers' Trainer and accelerate leave it; 0: the
    # gradients are views of the buckets, ours-torch since it sets it), and the all-reduce's work
    # buffers of up to ``DDP_INFLIGHT_MB`` (two of its 25 MB buckets); Jittor's MPI all-reduce adds
    # none (measured: its ranks' peaks below one process's, as ``mpi_load_delta_mb`` has them)
    dp_grad_copies: float = 1.0
    # DDP's construction broadcast (``_sync_module_states``) covers the frozen parameters too
    # (transformers' Trainer and accelerate give DDP none to ignore; ours-torch ignores them): it
    # writes every parameter on every rank, so a memory-mapped frozen base becomes the process's
    # own memory (measured: transformers + peft's LoRA over 2 ranks, llama-bench, +405 MB anonymous
    # per rank from the model's construction on, its 407 MB of mapped fp32 weights)
    dp_syncs_frozen: bool = False
    # FSDP2's root unit (embeddings, final norm, head) at ZeRO-3: 1 where it stays gathered from its
    # forward to its backward (ours-torch since 7f22b85: its reshard_after_forward left unset), 2 where
    # it is resharded after the forward and gathered again for the backward (transformers + peft as
    # accelerate's FSDP2 plugin and the bench wrap it: the freed copy and the new one)
    fsdp2_root_copies: int = 2
    # activation checkpointing of a Llama layer whose MLP is frozen (LoRA on attention only) keeps
    # the MLP's input alone and runs its backward in pieces of ``mlp_chunk_rows`` tokens
    # (``lora_core.train.recompute``; the torch backend in float32, not under autocast)
    gc_frozen_mlp: bool = False
    # the frozen-head loss takes its logits in pieces of ``head_piece_rows`` positions (ours-torch
    # since 954ff8f; on a GPU 512-row pieces at Llama 3's vocabulary since 2656d2d, one piece before)
    head_pieces: bool = False
    # where the run's tensors live: "cpu", or "cuda" (a frozen MLP's recomputation whole, not in
    # pieces, the frozen head's logits in larger ones: ``lora_core.train.heap.PIECE_DEVICES``)
    device: str = "cpu"
    # the frozen head's pieces of this many bytes of float32 logits in place of the device's rule
    # (``heap.head_piece_rows``; None: the rule): a record of a run made with other pieces
    head_piece_bytes: int | None = None
    # under autocast, whether the low-precision copy of each frozen projection weight lives from
    # its forward pass to its backward pass (autocast caches the casts of trained weights only:
    # transformers + peft, ours-torch before 2c82fba; every layer's, one layer's with GC). The
    # fitted constants include them; a system that keeps the float32 weight instead (ours-torch
    # since 2c82fba: backends/torch/lora.py, _AutocastFrozenLinear) has their bytes taken off
    frozen_casts_kept: bool = True
    # whether the fitted ``act_scale`` includes those copies (fitted on runs that kept them; then a
    # system with ``frozen_casts_kept=False`` has their bytes taken off): False, fitted on runs
    # that did not keep them (ours-torch-cuda since a8d4e9a), nothing taken off
    casts_in_fit: bool = True
    # a frozen head's loss counted as it allocates, not scaled by ``act_scale`` (ours-torch's
    # ``_HeadNLL`` on a GPU, ``backends/torch/train.py``): one piece's float32 logits, and under
    # autocast that piece's bf16 logits and bf16 gradient and the (V, E) weight cast once
    frozen_head_exact: bool = False
    # the model kinds whose training steps can return glibc's freed heap at each layer
    # (``lora_core.train.heap``: by default with GC or a 4-bit base), and the constants of a run
    # that does not (the fields above are those of one that does)
    trim_kinds: tuple[str, ...] = ()
    untrimmed: dict = field(default_factory=dict)
    # the constants of a run under tcmalloc (``lora_core.train.allocator``: ours-torch's Llama runs
    # where it is installed, by default), in place of the fields above; empty: not modelled
    tcmalloc: dict = field(default_factory=dict)
    family: dict = field(default_factory=dict)  # per model kind: the fields above that differ (``for_kind``)
    # bf16 as torch.autocast: weights, gradients and AdamW moments stay float32, the activations
    # bf16 (ours-torch's set_precision, the benches' hf-peft); False: weights held in bf16 (a
    # model loaded in bf16, full FT with fp32 master weights in the optimizer)
    autocast: bool = False
    note: str = ""

    @property
    def engines(self) -> tuple[str, ...]:
        """The ZeRO engines this system's runs shard on, its default first."""
        return (self.zero_engine, *(e for e in self.zero_engines if e != self.zero_engine))

    def for_kind(self, kind: str) -> System:
        """The system with ``family[kind]``'s counts in place of the defaults (a model family
        built from other ops: Jittor's GPT-2 LayerNorm and attention are not its Llama's)."""
        return dataclasses.replace(self, **self.family.get(kind, {})) if kind in self.family else self


# Measured and fitted on the CPU methods bench (docs/planning.md, docs/bench/lm_methods_*.json;
# the fit of validate.FITTED: ``python -m lora_core.plan.validate --fit docs/bench/lm_methods_*.json``).
# data parallelism without ZeRO (ours-torch, 3 steps of full FT, llama-bench with a 257-token
# vocabulary, 2 x 127 tokens per rank, 346 MB of gradients): 2 ranks held 41 and 87 MB more than
# one process with the gradients as DDP's bucket views, 330 and 345 MB more without (the same
# losses); LoRA (1 MB of gradients) 2 MB more: DDP's in-flight all-reduce buffers, counted as two
# of its 25 MB buckets (System.dp_grad_copies). ours-jittor, the same run under mpirun: 1962 and
# 1966 MB per rank, 2133 MB in one process (planned: mpi_load_delta_mb, -117 MB, nothing more)
DDP_INFLIGHT_MB = 50.0

SYSTEMS: dict[str, System] = {
    # Llama with the heap trimmed at each layer (4a04648; by default since c2cfa46 only with GC or
    # a 4-bit base): no growth by layer, nothing of full FT's activations kept, heap and act_scale
    # fitted (refitted at fb02de2, GC's MLP, NF4 quantization and the frozen-head logits in pieces:
    # its GC and QLoRA rows measured again; and at 7b0a1cb, the pieces over glibc's mmap ceiling: the
    # 128k-vocabulary rows measured again); a run that does not trim (GPT-2's layers never do) keeps
    # the constants fitted before 4a04648 on the Llama rows measured without trimming
    "ours-torch": System("ours-torch", base_mb=146.0, load_mb=71.0, load_4bit_mb=0.0, mapped_kinds=("llama",),
                         act_scale=0.783, heap=0.513, heap_layers=0.0, full_heap=0.0, head_nv_frozen=1, deq_buffer_mb=16.0,
                         trim_kinds=("llama",),
                         untrimmed={"act_scale": 0.82, "heap": 0.613, "heap_layers": 0.188, "full_heap": 0.236},
                         # under tcmalloc (lora_core.train.allocator; the commands' default since dd3853f):
                         # baseline and load measured (tiny-llama's rows), heap and act_scale fitted on
                         # the six shapes' rows at 98c5579/dd3853f, 954ff8f, fb02de2 and 5d35d43 (docs/planning.md)
                         tcmalloc={"base_mb": 152.0, "load_mb": 76.0, "act_scale": 0.782, "heap": 0.127, "heap_layers": 0.0,
                                   "full_heap": 0.0},
                         # fitted on float32 rows alone: no bf16 copy of a frozen weight in the fit to take off
                         autocast=True, gc_frozen_mlp=True, head_pieces=True, frozen_casts_kept=False,
                         casts_in_fit=False, fsdp2_root_copies=1, dp_grad_copies=0.0, note="PyTorch CPU, backends.torch"),
    "ours-jittor": System("ours-jittor", base_mb=20.0, load_mb=165.0, act_scale=1.432, heap=0.361, full_heap=1.0,
                          emb_copies=3.0, deq_kept=1.0, deq_kept_gc=0.788, silu_saved=4, norm_saved=3, attn_probs=2,
                          head_nv=1, lora_outs=2, zero_engine="mpi",
                          # under mpirun: 62-67 MB above the baseline once the model is built (LoRA, full FT;
                          # QLoRA 118) against 181-182 (229-237) in one process (docs/bench/lm_zero_*.json)
                          mpi_load_delta_mb=-117.0, zero_step_copies=3,
                          # GPT-2: its LayerNorm keeps its input, its attention one (T, T) matrix, with GC no
                          # dequantized weight kept (counted); fitted on two GPT-2 shapes (validate.FAMILY_FITTED,
                          # checked on a third): the tied (V, E) table's backward buffers (5: the embedding's 3
                          # + the head's weight gradient and the sum), the head's (N, V) tensors, the heap by layer
                          family={"gpt2": {"norm_saved": 1, "attn_probs": 1, "deq_kept_gc": 0.0, "emb_copies": 5.016,
                                           "head_nv": 1.538, "heap_layers": 0.181}},
                          note="Jittor CPU, backends.jittor"),
    # act_scale fitted with the heap constants since 2026-11-28 (0.79 before, measured on one shape with
    # glibc's mmap threshold fixed at 128 kB): 4 of its Llama rows had been 10.1-10.6% off, none is now
    "hf-peft": System("hf-peft", base_mb=146.0, load_mb=162.0, mapped_kinds=("llama", "gpt2"), dp_syncs_frozen=True,
                      act_scale=0.96, heap=0.332,
                      heap_layers=0.19, full_heap=0.789, silu_saved=3, head_nv=4, lora_outs=3,
                      gelu_saved=4, gelu_allocs=8, zero_engines=("fsdp2", "deepspeed"),
                      autocast=True, note="transformers + peft, PyTorch CPU"),
    # CUDA (one H200, f03e958: docs/bench/gpu/h200_lm_llama-3.2-1b-L4_f03e958.json, bf16 autocast):
    # the peak without the overhead is compared with torch.cuda.max_memory_allocated, the overhead
    # is the CUDA context and libraries (device use minus the allocator's reserve: 767 MB on both);
    # the caching allocator keeps freed blocks, but they are not allocated: no heap terms. Fitted
    # (act_scale, head counts, emb_copies, full_heap) on that run's five rows per system, one
    # shape (Llama-3.2-1B widths, 4 layers, batch 4 x 512): max error 6.0% (ours), 4.3% (HF);
    # act_scale ~2 x the bf16 count: under autocast the norms and the residual stream stay fp32.
    # ours-torch's LoRA and QLoRA rows since a8d4e9a (the frozen head's loss in one piece, its
    # weight cast once, no frozen weight's bf16 copy kept): the head counted as allocated, the
    # larger of the loss's and the backward's moments (System.frozen_head_exact), act_scale 1.1
    # fitted on that run's eight rows (16 layers bf16, 4 layers float32 with the math attention
    # kernel it ran: validate.GPU_AS_RUN), max error 4.0%; no other run holds them out
    "ours-torch-cuda": System("ours-torch-cuda", base_mb=767.0, load_mb=0.0, heap_ceiling_mb=None, autocast=True,
                              act_scale=1.1, head_nv=2, head_nv_frozen=1, emb_copies=1.0, full_heap=0.5, gc_frozen_mlp=True,
                              head_pieces=True, device="cuda", frozen_casts_kept=False, casts_in_fit=False,
                              frozen_head_exact=True,
                              fsdp2_root_copies=1, dp_grad_copies=0.0,
                              note="PyTorch CUDA, backends.torch, bf16 autocast; fitted on two H200 runs, two shapes"),
    "hf-peft-cuda": System("hf-peft-cuda", base_mb=767.0, load_mb=0.0, heap_ceiling_mb=None, autocast=True, device="cuda",
                           zero_engines=("fsdp2", "deepspeed"),
                           act_scale=1.75, head_nv=2, emb_copies=1.0, full_heap=1.0, silu_saved=3, lora_outs=3,
                           note="transformers + peft (+ bitsandbytes) on CUDA, bf16 autocast; fitted on one H200 run, one shape"),
    "gpu": System("gpu", base_mb=500.0, load_mb=0.0, act_scale=1.1, full_heap=1.1, heap_ceiling_mb=None, device="cuda",
                  zero_engine="deepspeed", zero_engines=("deepspeed", "fsdp2"),
                  note="assumed, unmeasured here: CUDA context ~500 MB, the caching allocator ~10% above the "
                       "activations, full FT's activations alive with its gradients"),
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
    with fp32 master weights; LoRA's adapters and their moments in fp32, as peft keeps them;
    a ``System.autocast`` system: the activations only, every weight stays fp32)."""

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
    heap_trim: str = "auto"  # LORA_MALLOC_TRIM's mode (lora_core.train.heap): auto, on, off
    # LORA_ALLOCATOR's mode (lora_core.train.allocator): auto (ours-torch's Llama runs under
    # tcmalloc, as the commands run them where it is installed), glibc, tcmalloc
    allocator: str = "auto"
    # the rule of the frozen head's pieces of rows on the CPU (``heap.head_piece_rows``): "reach"
    # (today's: the fewest rows over glibc's mmap ceiling), "within" (a run before 7b0a1cb)
    head_pieces: str = HEAD_PIECE_RULE
    # what shards a ZeRO run (zero 2|3): one of the system's ``System.engines`` (None: its default)
    zero_engine: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(dict.fromkeys(self.targets)))  # a set, in order (as peft's)
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
        if self.heap_trim not in TRIM_MODES:
            raise ValueError(f"heap_trim {self.heap_trim!r} is not one of {TRIM_MODES}")
        if self.allocator not in ALLOCATOR_MODES:
            raise ValueError(f"allocator {self.allocator!r} is not one of {ALLOCATOR_MODES}")
        if self.head_pieces not in HEAD_PIECE_RULES:
            raise ValueError(f"head_pieces {self.head_pieces!r} is not one of {HEAD_PIECE_RULES}")
        for name in ("r", "batch", "seq"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < (0 if name == "r" else 1):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.zero_engine is not None:
            if self.zero not in (2, 3):
                raise ValueError(f"zero engine {self.zero_engine} shards a ZeRO run: it needs ZeRO stage 2 or 3, "
                                 f"not {self.zero}")  # fmt: skip
            engines = SYSTEMS[self.system].engines
            if self.zero_engine not in engines:
                raise ValueError(f"zero engine {self.zero_engine}: {self.system} runs ZeRO on {' or '.join(engines)} only")
        if self.method != "full" and (not self.targets or self.r < 1):
            raise ValueError(f"{self.method} needs targets and r >= 1, got {self.targets!r}, r={self.r}")


@dataclass
class Plan:
    """A prediction (MB per rank): the peak and its parts (module docstring); ``mapped``: frozen
    weights left as the checkpoint's file pages (in RSS, not in the peak); ``per_layer``: one
    layer's saved activations by what keeps them."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    overhead: float
    peak: float = 0.0
    retained: float = 0.0
    mapped: float = 0.0
    per_layer: dict[str, float] = field(default_factory=dict)
    per_layer_gc: float = 0.0
    per_layer_nogc: float = 0.0
    head: float = 0.0
    params: int = 0
    trainable: int = 0
    flops_per_token: float = 0.0
    flops_note: str = ""
    allocator: str = ""  # the allocator the run resolves to ("tcmalloc", "glibc, heap trim per layer on"; "": not modelled)


def check_sequence(cfg, seq: int) -> None:
    """Refuse a sequence length the model cannot run (as its forward pass refuses it): GPT-2's
    ``n_positions``, a Llama family's ``max_position_embeddings`` and ``sliding_window``."""
    from ..models import check_length

    try:
        check_length(cfg, seq)
    except ValueError as e:
        raise ValueError(f"seq {seq}: {e}") from None


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
        out["attention probabilities (unfused)"] = sysm.attn_probs * a.heads * c.seq
        out["GELU (input[, tanh, 1 + tanh, x / 2])"] = sysm.gelu_saved * a.ffn
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


def _largest_trained(a: Arch, c: PlanConfig) -> int:
    """Elements of the largest trained tensor: full FT's embedding table or widest projection;
    with LoRA the largest A or B matrix."""
    if c.method == "full":
        return max([a.vocab * a.hidden] + [i * o for i, o in a.proj.values()])
    return max(c.r * max(a.proj[t]) for t in c.targets)


def layer_allocs(a: Arch, c: PlanConfig, lora_outs: int = 1, gelu_allocs: int = 1) -> dict[int, float]:
    """Elements per token one layer's forward pass allocates (saved or freed), by tensor width:
    an estimate read off the ops. Llama: RMSNorm 3 x hidden each (x^2, normalised, scaled), the
    q/k/v/o outputs, RoPE's products and half-rotations (4 per q/k width), SDPA's inputs and
    output laid out, the residual adds, SwiGLU's gate, up, silu and product (4 ffn); GPT-2 the
    same with q = kv = hidden and GELU's products; LoRA: r and ``lora_outs`` outputs per adapted
    projection (ours-torch: 1, the fused addmm; jittor: 2, the scaled product and the sum; peft: 3,
    the B product, its scaling and the sum)."""
    E, q, kv, F = a.hidden, a.q, a.kv, a.ffn
    out: dict[int, float] = {}
    for width, n in ((E, 11), (q, 9), (kv, 10), (F, 4)) if a.kind == "llama" else ((E, 32), (F, 2 + gelu_allocs)):
        out[width] = out.get(width, 0) + n
    if c.method != "full":
        for t in c.targets:
            width = a.proj[t][1]
            out[width] = out.get(width, 0) + lora_outs
            out[c.r] = out.get(c.r, 0) + 1
    return out


def _below(nbytes: float, ceiling_mb: float | None) -> bool:
    return ceiling_mb is None or nbytes < ceiling_mb * MB


def _state(a: Arch, c: PlanConfig, sysm: System, total: int, trainable: int, quantized: int, trims: bool = False):
    """Weights (the process's own bytes, and the mapped file pages), gradients, optimizer state;
    ``trims``: the run returns glibc's freed heap at each layer (``lora_core.train.heap``)."""
    bf16 = c.precision == "bf16" and not sysm.autocast  # weights held in bf16
    wb = 2 if bf16 else 4  # bytes of a weight as held (frozen; full FT's working copy)
    frozen = total - trainable
    mapped = 0.0
    if c.method == "full":
        weights, grad_b, opt_b = total * wb, wb, 8 + (4 if bf16 else 0)  # bf16: fp32 master in the optimizer
    else:  # adapters in fp32 (peft upcasts them), frozen base as held (or mapped) or 4-bit
        held = (frozen - quantized) * wb
        mapped = held if a.kind in sysm.mapped_kinds and not bf16 else 0.0  # a bf16 copy is the process's own
        weights = held - mapped + quantized * NF4_BYTES + trainable * 4
        grad_b, opt_b = 4, 8
    shard_opt = c.ranks if c.zero >= 2 else 1
    shard_grads = 1 if sysm.zero_engine == "mpi" else shard_opt  # Jittor's MPI engine all-reduces them whole
    trained_b = trainable * (wb if c.method == "full" else 4)
    if c.zero == 2 and sysm.zero_engine == "fsdp2":  # the trained parameters: a shard each, gathered whole
        weights += trained_b / c.ranks  # from the forward to the end of the backward (no resharding between)
    if c.zero == 3:
        # every parameter a shard in the process's own memory (copied: the mapped pages are left
        # unused), 4-bit codes whole (buffers, or bitsandbytes' ignored Params4bit); gathered whole
        # during the step: the root unit's (embeddings, final norm, head: FSDP2 keeps the root
        # gathered from forward to backward) and two layers (the one computed and the next)
        # (DeepSpeed shards the 4-bit codes too: bitsandbytes' quant_storage, as HF's ZeRO-3 QLoRA recipe)
        ds = sysm.zero_engine == "deepspeed"
        whole = 0.0 if ds else quantized * NF4_BYTES
        own = weights + mapped - whole
        mapped = 0.0
        lora_layer = (trainable / a.layers) if c.method != "full" else 0
        proj = sum(i * o for i, o in a.proj.values())
        layer = proj * ((NF4_BYTES if ds else 0) if quantized else wb) + a.layer_small * wb + lora_layer * 4
        # DeepSpeed gathers each module as it runs: of the root's, one (V, E) table at a time
        root = a.vocab * a.hidden if ds else a.other_params
        layers = min(2, a.layers) * layer
        # FSDP2 holds a gathered layer twice: its all-gather output and the parameters copied out of
        # it; a run that trims the heap at each layer gets the freed all-gather outputs of the layers
        # returned there, and holds the gathered layers once; the root: System.fsdp2_root_copies
        held = 1 if trims else 2
        weights = whole + own / c.ranks + ((root * wb + layers) * (1 - 1 / c.ranks) if ds
                                           else sysm.fsdp2_root_copies * root * wb + held * layers)
    grads = trainable * grad_b / shard_grads
    if c.zero == 0 and c.ranks > 1 and sysm.zero_engine != "mpi" and sysm.dp_syncs_frozen:
        weights, mapped = weights + mapped, 0.0  # DDP's broadcast wrote the mapped frozen base: now its own
    if c.zero == 0 and c.ranks > 1 and sysm.zero_engine != "mpi":  # DDP: its buckets and all-reduce buffers
        grads += sysm.dp_grad_copies * trainable * grad_b + min(trainable * grad_b, DDP_INFLIGHT_MB * MB)
    if c.method == "full" and c.zero and sysm.zero_engine == "fsdp2":
        # a unit's whole gradients and its reduce-scatter input, the root's (embeddings, head) last
        grads += 2 * a.other_params * grad_b
    return weights, mapped, grads, trainable * opt_b / shard_opt


def frozen_mlp_pieces(a: Arch, c: PlanConfig, sysm: System) -> bool:
    """Whether a GC run's recomputed layer keeps of its MLP only the input (``System.gc_frozen_mlp``:
    a Llama layer whose gate, up and down projections are frozen, float32, without ZeRO, whose
    engines run each layer with their hooks: recomputed whole)."""
    mlp = {"gate_proj", "up_proj", "down_proj"}
    return (sysm.gc_frozen_mlp and c.gc and a.kind == "llama" and c.method != "full" and not mlp & set(c.targets)
            and c.precision == "fp32" and not c.zero)  # fmt: skip


def _activations(a: Arch, c: PlanConfig, sysm: System, per_layer: dict, quantized: int):
    """Live activations at the peak, the retained heap, and the counted parts (bytes)."""
    ab = 2 if c.precision == "bf16" else 4
    N, ceil = c.batch * c.seq, sysm.heap_ceiling_mb
    nogc = sum(per_layer.values())
    transient = (5 * a.ffn + 2 * a.hidden) * ab  # SwiGLU's backward: its gradient, sigmoid, products, both grads
    recomputed = nogc
    if frozen_mlp_pieces(a, c, sysm):  # the MLP keeps its input, not gate and up; its backward in pieces
        recomputed += a.hidden - per_layer["SwiGLU (gate, up[, silu])"]
        transient = (5 * a.ffn * mlp_chunk_rows(N, a.ffn, ab, device=sysm.device) / N + 2 * a.hidden) * ab
    saved = a.layers * a.hidden + recomputed if c.gc else a.layers * nogc  # GC: each layer's input, one layer recomputed
    # LM head and loss (fp32): the final norm's input (and the head's, trained), log-softmax's
    # output (+ the logits where the caller holds them), then two (N, V) gradients
    nv = 4 * N * a.vocab
    # LoRA's loss keeps no (N, V) tensor (ours-torch, logits of HEAD_FUSED_MIN_BYTES or more)
    frozen_head = c.method != "full" and sysm.head_nv_frozen is not None and nv >= HEAD_FUSED_MIN_BYTES
    # ... and takes them in pieces of rows (System.head_pieces): one piece's (rows, V) at a time
    piece = head_piece_rows(N, a.vocab, sysm.device, sysm.head_piece_bytes, c.head_pieces) / N if frozen_head and sysm.head_pieces else 1.0
    head = 4 * (a.hidden * (2 if c.method == "full" else 1)
                + (sysm.head_nv_frozen * piece if frozen_head else sysm.head_nv) * a.vocab)  # fmt: skip
    exact = 0.0  # bytes of a frozen head's loss counted as allocated (System.frozen_head_exact)
    if frozen_head and sysm.frozen_head_exact:  # one piece's: bf16 logits + float32 copy + bf16 gradient
        cast = c.precision == "bf16" and sysm.autocast
        head = 4 * a.hidden
        exact = N * piece * (8 if cast else 4) * a.vocab + (2 * a.vocab * a.hidden if cast else 0)
    counted = N * (saved * ab + head + transient)
    proj = [i * o for i, o in a.proj.values()]
    if c.method == "full":  # the embedding's backward, once the activations are freed
        live = sysm.emb_copies * a.vocab * a.hidden * (2 if c.precision == "bf16" and not sysm.autocast else 4)
    else:
        quant_tmp = max(proj) * 4 if quantized and sysm.deq_buffer_mb is None else 0  # one dequantized weight
        live = sysm.act_scale * (counted + quant_tmp) + (sysm.deq_buffer_mb or 0) * MB * bool(quantized)
        if exact:  # the larger of two moments: the loss (the layers' saved tensors and the head's) and
            # the backward pass (a GC run's recomputed layer and the transients, the head's freed)
            kept = a.layers * (a.hidden if c.gc else nogc)
            live = max(sysm.act_scale * N * (kept * ab + head) + exact, live - sysm.act_scale * N * head)
        live += (sysm.deq_kept_gc if c.gc else sysm.deq_kept) * 4 * quantized
        casts_off = not sysm.frozen_casts_kept and sysm.casts_in_fit
        if c.precision == "bf16" and sysm.autocast and casts_off and not quantized:
            live -= 2 * sum(proj) * (1 if c.gc else a.layers)  # no bf16 copy of a frozen weight kept
    # the heap: one layer's forward allocations, the head's (N, V) tensors, QLoRA's dequantized
    # weights (forward and backward), each below the ceiling (mmapped above it: returned when freed)
    layer = sum(n * N * w * ab for w, n in layer_allocs(a, c, sysm.lora_outs, sysm.gelu_allocs).items() if _below(N * w * ab, ceil))
    one = nv * piece  # one (N, V) allocation of the head (a frozen head's: one piece, one allocation)
    heap = layer + ((1 if frozen_head else 4) * one if _below(one, ceil) else 0)
    heap += 2 * sum(4 * w for w in proj if _below(4 * w, ceil)) if quantized and sysm.deq_buffer_mb is None else 0
    retained = sysm.heap * heap + sysm.heap_layers * a.layers * layer  # and it grows by layer
    if c.method == "full":  # activations freed in the heap stay with the gradients
        kept = N * (saved * ab + transient) + (N * head if _below(nv, ceil) else 0)
        retained += sysm.full_heap * kept
    return live, retained, saved, head + exact / N


def plan(cfg, c: PlanConfig, sysm: System | None = None) -> Plan:
    """The per-rank peak of one training run (module docstring); ``cfg`` a model config;
    ``sysm``: a ``System`` in place of ``SYSTEMS[c.system]`` (fitting its constants)."""
    a = arch_of(cfg)
    check_sequence(cfg, c.seq)
    sysm = (sysm or SYSTEMS[c.system]).for_kind(a.kind)
    if c.zero_engine:
        sysm = dataclasses.replace(sysm, zero_engine=c.zero_engine)
    quantized_base = c.method == "qlora"
    allocator = ""  # what the run's allocator resolves to (systems with a heap trim)
    trims = False
    if sysm.tcmalloc and under_tcmalloc(c.allocator, c.system, a.kind):  # no heap trim there
        sysm, allocator = dataclasses.replace(sysm, **sysm.tcmalloc), "tcmalloc"
    elif sysm.trim_kinds:
        trims = run_trims(a.kind, sysm.trim_kinds, c.heap_trim, c.gc, quantized_base)
        allocator = f"glibc, heap trim per layer {'on' if trims else 'off'}"
        if sysm.untrimmed and not trims:
            sysm = dataclasses.replace(sysm, **sysm.untrimmed)
    if sysm.zero_engine not in ZERO_ENGINES:
        raise ValueError(f"System.zero_engine must be one of {ZERO_ENGINES}, got {sysm.zero_engine!r}")
    if c.zero == 3 and sysm.zero_engine == "mpi":
        raise ValueError(f"ZeRO stage 3 is not available in {c.system} (its MPI engine shards the AdamW moments "
                         "only: stage 2); plan --zero 2, or a torch system")  # fmt: skip
    per_layer = layer_saved(a, c, sysm)  # refuses unknown targets first
    total, trainable, quantized = _params(a, c)
    weights, mapped, gradients, optimizer = _state(a, c, sysm, total, trainable, quantized, trims)
    live, retained, saved, head = _activations(a, c, sysm, per_layer, quantized)
    base = sysm.base_mb if c.overhead_mb is None else c.overhead_mb
    mpi = sysm.zero_engine == "mpi" and c.ranks > 1
    overhead = (base + sysm.load_mb + (sysm.load_4bit_mb if quantized else 0) + (sysm.mpi_load_delta_mb if mpi else 0)) * MB
    if mpi and c.zero == 2:  # the sharded step's transient copies of one trained tensor, the largest
        live += sysm.zero_step_copies * 4 * _largest_trained(a, c)
    peak = weights + gradients + optimizer + live + retained + overhead
    flops, note = flops_per_token(cfg, a, c, total, trainable)
    ab, tokens, nogc = (2 if c.precision == "bf16" else 4), c.batch * c.seq, sum(per_layer.values())
    return Plan(weights / MB, gradients / MB, optimizer / MB, live / MB, overhead / MB, peak / MB, retained / MB,
                mapped / MB, {k: v * tokens * ab / MB for k, v in per_layer.items()},
                a.hidden * ab * tokens / MB, nogc * ab * tokens / MB, tokens * head / MB,
                total, trainable, flops, note, allocator)  # fmt: skip


def flops_per_token(cfg, a: Arch, c: PlanConfig, total: int, trainable: int) -> tuple[float, str]:
    """Training FLOPs per token: forward 2 per weight multiply-add (M) plus attention (A);
    the backward's input gradients another M + A, and weight gradients M only for trained
    weights (so full FT ~ 6N, LoRA ~ 4N: frozen weights get no weight gradient); GC adds
    the layers' forward (~2N, the LM head not) more."""
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
    if c.gc:  # each layer's forward again (the LM head is not in a checkpointed layer)
        f += M - 2 * a.vocab * a.hidden + A + (0 if c.method == "full" else L)
        how += "; GC: + the layers' forward (~2N) recomputed"
    return float(f), how


def _count(n: float, unit: str = "") -> str:
    """``n`` with three significant figures and a decimal prefix: 1.24 B, 24.3 M, 38.9 k, 512."""
    for scale, prefix in ((1e9, "B" if not unit else "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.3g} {unit}".rstrip()


def fmt_plan(p: Plan, c: PlanConfig, name: str) -> str:
    """The plan as the console prints it."""
    sysm = SYSTEMS[c.system]
    lines = [f"model {name}: {_count(p.params)} parameters, {_count(p.trainable)} trainable "
             f"({c.method}{'' if c.method == 'full' else f' r={c.r} on ' + ','.join(c.targets)}), {c.precision}, "
             f"GC {'on' if c.gc else 'off'}, ZeRO-{c.zero}{f' on {c.zero_engine or sysm.zero_engine}' if c.zero else ''} over {c.ranks} rank(s), micro-batch {c.batch} x {c.seq} tokens, "
             f"system {c.system} ({sysm.note})"
             + (f", allocator {p.allocator}{' (auto)' if c.allocator == 'auto' else ''}" if p.allocator else ""),
             f"{'per-rank peak':24s} {p.peak:10.1f} MB  ({p.peak / 1024:.2f} GiB)",
             f"  {'weights':22s} {p.weights:10.1f} MB",
             *(["    (DDP's construction broadcast writes the frozen base on every rank: its own memory, "
                "not mapped file pages)"] if c.zero == 0 and c.ranks > 1 and sysm.zero_engine != "mpi"
               and sysm.dp_syncs_frozen and c.method != "full" else []),
             f"  {'gradients':22s} {p.gradients:10.1f} MB",
             *([f"    (data parallel over {c.ranks} ranks without ZeRO: DDP's gradient buckets "
                f"{'as views of the gradients' if sysm.dp_grad_copies == 0 else 'beside the gradients'} and "
                f"its all-reduce buffers)"] if c.zero == 0 and c.ranks > 1 and sysm.zero_engine != "mpi" else []),
             f"  {'optimizer state':22s} {p.optimizer:10.1f} MB",
             f"  {'activations':22s} {p.activations:10.1f} MB",
             f"  {'retained (freed, kept)' if c.method != 'full' else 'retained + activations':22s} {p.retained:10.1f} MB",
             *(["    (full fine-tuning: the activations freed in the backward pass stay allocated beside the "
                "gradients until the optimizer step, the peak)"] if c.method == "full" else []),
             f"  {'framework overhead':22s} {p.overhead:10.1f} MB",
             f"memory-mapped frozen weights {p.mapped:.1f} MB (checkpoint file pages: in RSS, not in the peak)",
             f"activations of one layer: {p.per_layer_nogc:.1f} MB without GC, {p.per_layer_gc:.1f} MB with GC "
             f"(its input); LM head and loss {p.head:.1f} MB"]  # fmt: skip
    lines += [f"    {k:36s} {v:8.1f} MB" for k, v in p.per_layer.items() if v]
    lines.append(
        f"FLOPs per token {_count(p.flops_per_token, 'FLOP')} ({p.flops_per_token / p.params:.2f} x N): {p.flops_note}"
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
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: a folder without a config.json (a model folder holds one)")
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


# examples.lm.bench_systems: LoRA r 8 on Llama's attention projections, on GPT-2's c_attn and attn.c_proj
BENCH_TARGETS, GPT2_BENCH_TARGETS, BENCH_R = ("q_proj", "k_proj", "v_proj", "o_proj"), ("c_attn", "attn.c_proj"), 8


# the methods bench's row names: BASE[-dp|-zSTAGE][-gc] (examples.lm.bench_systems); -dp: data
# parallel over the bench's ranks without sharding (DDP in torch, MPI all-reduce in jittor)
BENCH_METHODS = tuple(f"{b}{z}{g}" for b in METHODS for z in ("", "-dp", "-z2", "-z3") for g in ("", "-gc"))


def bench_method(name: str) -> tuple[str, int, bool]:
    """``(method, ZeRO stage, GC)`` of a methods-bench row name: ``"qlora-z3-gc"`` ->
    ``("qlora", 3, True)``; ``ValueError`` naming the valid names for another."""
    if name not in BENCH_METHODS:
        raise ValueError(f"unknown bench method {name!r}; choose from {', '.join(BENCH_METHODS)}")
    base, *rest = name.split("-")
    zero = next((int(r[1:]) for r in rest if r.startswith("z")), 0)
    return base, zero, "gc" in rest


def bench_ranked(name: str) -> bool:
    """Whether a methods-bench row runs over several processes: its data-parallel (``-dp``) and
    ZeRO (``-z2``, ``-z3``) rows; ``ValueError`` as :func:`bench_method` for an unknown name."""
    return bool(bench_method(name)[1]) or "dp" in name.split("-")[1:]


def bench_plan(
    shape: str,
    layers: int | None,
    batch: int,
    block: int,
    system: str,
    method: str,
    vocab: int | None = None,
    sysm: System | None = None,
    ranks: int = 2,
    zero_engine: str | None = None,
    heap_trim: str = "auto",
    precision: str = "fp32",
    allocator: str = "auto",
    head_pieces: str = HEAD_PIECE_RULE,
) -> Plan:
    """The plan of one row of ``examples.lm.bench --methods`` (method ``full``, ``lora-gc``,
    ``lora-z2``, ...: :func:`bench_method`) on a Llama-family or GPT-2 preset; ``layers``,
    ``vocab``: the bench's overrides of the preset (None: the preset's); ``sysm``: a ``System``
    in place of ``SYSTEMS[system]``; ``ranks``: the processes of a data-parallel or ZeRO row (``batch`` rows each);
    ``zero_engine``: the row's ZeRO engine in place of the system's (hf-peft on DeepSpeed);
    ``heap_trim``: the run's ``LORA_MALLOC_TRIM`` mode (``auto``, ``on``, ``off``); ``precision``:
    the run's (``examples.lm.gpu_bench --precision``); ``allocator``: its ``LORA_ALLOCATOR`` mode;
    ``head_pieces``: the rule of its frozen head's pieces (``PlanConfig.head_pieces``)."""
    from ..models import preset_config
    from ..models.gpt2 import GPT2Config

    cfg = preset_config(shape, layers, vocab)
    targets = GPT2_BENCH_TARGETS if isinstance(cfg, GPT2Config) else BENCH_TARGETS
    base, zero, gc = bench_method(method)
    c = PlanConfig(method=base, targets=targets, r=BENCH_R, gc=gc, batch=batch, seq=block, system=system, zero=zero,
                   ranks=ranks if bench_ranked(method) else 1, heap_trim=heap_trim, precision=precision, allocator=allocator,
                   head_pieces=head_pieces, zero_engine=zero_engine if zero else None)  # fmt: skip
    return plan(cfg, c, sysm)
