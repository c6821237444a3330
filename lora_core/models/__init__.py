"""Model families, one module each with its whole spec (config, presets, names and shapes, initial values, checkpoint key maps), and the construction both backends share."""


def preset_config(shape: str, layers: int | None = None, vocab: int | None = None):
    """A decoder preset by name, Llama family (``llama.PRESETS``) or GPT-2 (``gpt2.PRESETS``),
    with a layer count and a vocabulary size in place of the preset's (None: the preset's)."""
    from . import gpt2, llama

    if shape in gpt2.PRESETS:
        over = {"n_layer": layers, "vocab_size": vocab}
        return gpt2.gpt2_config(shape, **{k: v for k, v in over.items() if v})
    if shape in llama.PRESETS:
        over = {"num_hidden_layers": layers, "vocab_size": vocab}
        return llama.llama_config(shape, **{k: v for k, v in over.items() if v})
    raise ValueError(f"unknown model preset {shape!r}; choose from {sorted(llama.PRESETS) + sorted(gpt2.PRESETS)}")


def check_length(cfg, total: int) -> None:
    """Refuse a sequence of ``total`` tokens that ``cfg``'s model cannot run, as its forward pass
    refuses it: a Llama family's ``max_position_embeddings`` and ``sliding_window``
    (``llama.check_length``), GPT-2's ``n_positions`` (``gpt2.check_length``)."""
    from . import gpt2, llama

    (llama.check_length if isinstance(cfg, llama.LlamaConfig) else gpt2.check_length)(cfg, total)
