"""Canonical parameter names and shapes of GPT-2 with LoRA.

Names are HF GPT-2's without the ``transformer.`` prefix (``h.0.attn.c_attn.weight``);
LoRA parameters follow loralib (``h.0.attn.c_attn.lora_A``). Every weight is stored
(out, in) like ``nn.Linear``; HF/OpenAI checkpoints store GPT-2's ``Conv1D`` weights
(in, out), and ``TRANSPOSED`` lists them for the one place that transposes
(``checkpoint.load_gpt2_checkpoint``), as nanoGPT does.
"""

from __future__ import annotations

from .config import GPT2Config, LoRAConfig

# Conv1D weights in HF/OpenAI checkpoints, stored (in, out): transposed once on load.
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Buffers some checkpoints carry that are not parameters (the causal mask): dropped by name.
NON_PARAMETER_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def is_non_parameter(name: str) -> bool:
    """``h.3.attn.bias`` (a mask buffer), not ``h.3.attn.c_attn.bias`` (a parameter)."""
    return name.startswith("h.") and name.count(".") == 3 and name.endswith(NON_PARAMETER_SUFFIXES)
LORA_MARK = "lora_"


def base_shapes(cfg: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every base parameter, in module order."""
    E, V = cfg.n_embd, cfg.vocab_size
    shapes = {"wte.weight": (V, E), "wpe.weight": (cfg.n_positions, E)}
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        shapes.update({
            p + "ln_1.weight": (E,), p + "ln_1.bias": (E,),
            p + "attn.c_attn.weight": (3 * E, E), p + "attn.c_attn.bias": (3 * E,),
            p + "attn.c_proj.weight": (E, E), p + "attn.c_proj.bias": (E,),
            p + "ln_2.weight": (E,), p + "ln_2.bias": (E,),
            p + "mlp.c_fc.weight": (4 * E, E), p + "mlp.c_fc.bias": (4 * E,),
            p + "mlp.c_proj.weight": (E, 4 * E), p + "mlp.c_proj.bias": (E,),
        })
    shapes.update({"ln_f.weight": (E,), "ln_f.bias": (E,)})
    return shapes


def module_dims(cfg: GPT2Config) -> dict[str, tuple[int, int]]:
    """Adaptable module name -> (in_features, out_features); ``wte`` is (vocab, n_embd)."""
    E = cfg.n_embd
    dims = {"wte": (cfg.vocab_size, E)}
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        dims.update({p + "attn.c_attn": (E, 3 * E), p + "attn.c_proj": (E, E),
                     p + "mlp.c_fc": (E, 4 * E), p + "mlp.c_proj": (4 * E, E)})
    return dims


def matches_target(module: str, target: str) -> bool:
    """peft-style match: the full name or a dotted suffix (``c_proj`` matches both c_proj)."""
    return module == target or module.endswith("." + target)


def lora_modules(cfg: GPT2Config, lora: LoRAConfig) -> list[str]:
    """Names of the modules that ``lora`` adapts, in module order."""
    if lora.r == 0:
        return []
    return [m for m in module_dims(cfg) if any(matches_target(m, t) for t in lora.target_modules)]


def lora_shapes(cfg: GPT2Config, lora: LoRAConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every LoRA parameter (loralib layouts).

    Linear: A (r, in), B (out, r). Fused qkv with ``enable_lora`` of k slices:
    A (k*r, in), B (k*out/3, r) (loralib ``MergedLinear``). Embedding: A (r, vocab),
    B (n_embd, r) (loralib ``Embedding``: ``delta = (B @ A).T``).
    """
    shapes = {}
    for m in lora_modules(cfg, lora):
        fin, fout = module_dims(cfg)[m]
        k = 1
        if m.endswith("attn.c_attn") and lora.enable_lora is not None:
            k = sum(lora.enable_lora)
            fout = fout // 3 * k
        shapes[f"{m}.lora_A"] = (k * lora.r, fin)
        shapes[f"{m}.lora_B"] = (fout, lora.r)
    return shapes


def is_lora_name(name: str) -> bool:
    return LORA_MARK in name


def trainable_names(cfg: GPT2Config, lora: LoRAConfig) -> list[str]:
    """Names of what trains under ``lora.bias``: LoRA parameters and the chosen biases."""
    names = list(lora_shapes(cfg, lora))
    if lora.bias == "all":
        names += [n for n in base_shapes(cfg) if n.endswith(".bias")]
    elif lora.bias == "lora_only":
        names += [f"{m}.bias" for m in lora_modules(cfg, lora) if m != "wte"]
    return names


def count_parameters(shapes: dict[str, tuple[int, ...]]) -> int:
    total = 0
    for s in shapes.values():
        n = 1
        for d in s:
            n *= d
        total += n
    return total


def adapter_names(model) -> set[str]:
    """What an adapter of ``model`` holds: for a model with injected LoRA what its config
    trains; else names from its configs if it has them (``model.config``,
    ``model.lora_config``), else every ``lora_`` parameter name."""
    injected = getattr(model, "lora_injection", None)  # set by inject_lora (lora_core.injection)
    if injected is not None:
        return set(injected.trainable(n for n, _ in model.named_parameters()))
    cfg, lora = getattr(model, "config", None), getattr(model, "lora_config", None)
    if cfg is not None and lora is not None:
        return set(trainable_names(cfg, lora))
    return {n for n, _ in model.named_parameters() if LORA_MARK in n}
