"""The model shapes of ``examples.lm.bench``: a Llama-family preset
(``lora_core.models.llama.PRESETS``) or a GPT-2 one (``lora_core.models.gpt2.PRESETS``),
behind the few calls the bench needs (the config, the LoRA targets, the checkpoint folder of
random weights, the FLOP count, the GEMM shapes, the bytes a decoding step reads).

LoRA targets (r 8, alpha 16, ``bench_systems``): Llama's ``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``; GPT-2's attention projections, ``attn.c_attn`` (q, k, v fused, adapted as one
3E-wide matrix, as peft adapts it; not the LoRA paper's per-slice q, v form) and
``attn.c_proj``. Targets are dotted suffixes matched as peft matches them, so both systems
adapt the same modules: plain ``c_proj`` would adapt ``mlp.c_proj`` too.

The checkpoint folder is transformers': Llama's as ``LlamaConfig.to_hf_dict()`` names it,
GPT-2's as ``GPT2LMHeadModel.save_pretrained`` writes it (``transformer.`` prefix, Conv1D
weights (in, out), the tied head left out: ``lora_core.train.full_ft.hf_config`` /
``hf_tensors``), so that ``bk.from_pretrained`` and ``AutoModelForCausalLM.from_pretrained``
both load it.
"""

from __future__ import annotations

import json
from pathlib import Path

from lora_core.models import gpt2, llama, preset_config

SHAPES = tuple(sorted(llama.PRESETS) + sorted(gpt2.PRESETS))
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
GPT2_TARGETS = ("attn.c_attn", "attn.c_proj")


def shape_config(shape: str, layers: int | None = None, vocab: int | None = None):
    """The preset ``shape`` (``SHAPES``) with the bench's ``--layers`` / ``--vocab`` overrides."""
    return preset_config(shape, layers, vocab)


def is_gpt2(cfg) -> bool:
    return isinstance(cfg, gpt2.GPT2Config)


def targets(cfg) -> tuple[str, ...]:
    """The LoRA targets of the bench on ``cfg``'s family (module docstring)."""
    return GPT2_TARGETS if is_gpt2(cfg) else LLAMA_TARGETS


def check_sizes(args, tokens: int | None = None, **counts: int | None) -> str | None:
    """What is wrong with a bench command's sizes (None: nothing): ``--layers``/``--vocab`` given
    below 1 (0 fell back to the preset's), a count of ``counts`` (``batch=..``, option name with
    ``_`` for ``-``) below 1, or ``tokens`` (the longest sequence the run makes) past what the
    shape's model runs (positions, a sliding window: the planner's ``check_sequence``, the
    model's own refusal)."""
    for name in ("layers", "vocab"):
        if getattr(args, name, None) is not None and getattr(args, name) < 1:
            return f"--{name} must be >= 1 when given, got {getattr(args, name)}"
    for name, v in counts.items():
        if v is not None and v < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {v}"
    if tokens is not None:
        from lora_core.plan.memory import check_sequence

        try:
            check_sequence(shape_config(args.shape, args.layers, args.vocab), tokens)
        except ValueError as e:
            return f"--shape {args.shape}: {str(e).split(': ', 1)[1]}"
    return None


def positions(cfg) -> int:
    return cfg.n_positions if is_gpt2(cfg) else cfg.max_position_embeddings


def describe(cfg) -> str:
    """The shape's sizes, for the table's header."""
    if is_gpt2(cfg):
        return (f"GPT-2: hidden {cfg.n_embd}, layers {cfg.n_layer}, MLP {4 * cfg.n_embd}, heads {cfg.n_head}, "
                f"vocab {cfg.vocab_size}")  # fmt: skip
    return (f"hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers}, MLP {cfg.intermediate_size}, "
            f"heads {cfg.num_attention_heads}/{cfg.num_key_value_heads}, vocab {cfg.vocab_size}")  # fmt: skip


def projections(cfg) -> dict[str, tuple[int, int]]:
    """Every projection of every block (the modules LoRA can adapt, 4-bit in QLoRA): name ->
    (in, out), under our (canonical) names."""
    if is_gpt2(cfg):
        return {m: d for m, d in gpt2.module_dims(cfg).items() if m != "wte"}
    shapes = llama.base_shapes(cfg)
    return {n.removesuffix(".weight"): (s[1], s[0]) for n, s in shapes.items() if n.endswith("proj.weight")}


def flops_per_token(cfg, block: int) -> dict[str, float]:
    """Forward ``matmul`` and ``attention`` FLOPs per token (the family's ``count_flops_per_token``)."""
    return (gpt2 if is_gpt2(cfg) else llama).count_flops_per_token(cfg, block)


def gemm_shapes(cfg) -> list[tuple[int, int]]:
    """The distinct (in, out) of the model's projections and its LM head."""
    e = cfg.n_embd if is_gpt2(cfg) else cfg.hidden_size
    return sorted(set(projections(cfg).values()) | {(e, cfg.vocab_size)})


def weight_bytes(cfg) -> int:
    """Bytes of float32 weights one decoding step reads: every parameter but the lookup tables
    (token and GPT-2's position embeddings: a step reads only its rows of them), and the LM head
    once, tied or not. (Bench files written before 2026-11-28 counted the tables as read whole:
    at llama-bench 407 MB against 375 MB now, gpt2 622 MB against 472 MB.)"""
    if is_gpt2(cfg):  # wte and wpe are lookups; the tied head reads a (V, E) matrix
        n = sum(_numel(s) for s in gpt2.base_shapes(cfg).values()) - cfg.n_positions * cfg.n_embd
    else:  # embed_tokens is a lookup; the head (lm_head, or the tied embedding) a (V, E) matrix
        n = sum(_numel(s) for s in llama.base_shapes(cfg).values())
        if not cfg.tie_word_embeddings:
            n -= cfg.vocab_size * cfg.hidden_size
    return 4 * n


def write_checkpoint(cfg, folder: Path, seed: int) -> None:
    """Random weights (the family's seeded init) as a transformers checkpoint folder."""
    if is_gpt2(cfg):
        from lora_core.formats.hf_checkpoint import write_hf_checkpoint
        from lora_core.train.full_ft import hf_config, hf_tensors

        write_hf_checkpoint(folder, hf_config(cfg), hf_tensors(cfg, gpt2.init_gpt2_weights(cfg, seed)))
        return
    from safetensors.numpy import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=1))
    save_file(llama.init_llama_weights(cfg, seed), str(folder / "model.safetensors"), metadata={"format": "pt"})


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
