"""The systems of ``examples.lm.bench``: our backends and transformers + peft behind the same
calls (``train_step(rows)``, ``greedy(prompts, n)``, ``memory_parts()``), each loading the
bench's checkpoint folder and LoRA file, so that all start from the same weights (see the
bench's docstring), for one fine-tuning method of ``METHODS``:

- ``full``: every weight trains (no LoRA); ``lora``: LoRA r 8, alpha 16 on q, k, v, o (GPT-2:
  ``attn.c_attn`` whole and ``attn.c_proj``, ``bench_shapes``), the base frozen; ``qlora``: the
  same LoRA on a 4-bit NF4 base (double quantization; ours:
  ``from_pretrained(quantize="nf4")``, transformers: ``BitsAndBytesConfig`` +
  ``prepare_model_for_kbit_training``);
- ``-gc``: with activation checkpointing (ours: ``set_grad_checkpoint``; transformers:
  ``gradient_checkpointing_enable``, non-reentrant, as the studies run it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .bench_shapes import LLAMA_TARGETS, projections, targets

TARGETS = LLAMA_TARGETS
METHODS = ("full", "full-gc", "lora", "lora-gc", "qlora", "qlora-gc")
R, ALPHA, LR, SEED = 8, 16.0, 2e-4, 0


def lora_target_config(target_modules: tuple[str, ...] = TARGETS):
    from lora_core.lora.targeting import LoRATargetConfig

    return LoRATargetConfig(r=R, alpha=ALPHA, target_modules=target_modules, seed=SEED)


def lora_arrays(cfg, b_std: float = 0.0) -> dict[str, np.ndarray]:
    """Ours' seeded initial LoRA values (``init_lora_arrays``) for ``cfg``'s adapted projections;
    ``b_std > 0``: ``lora_B`` drawn from normal(0, b_std) instead of zeros (decoding)."""
    from lora_core.lora.targeting import init_lora_arrays, plan_injection

    modules = {n: ("linear", fin, fout) for n, (fin, fout) in projections(cfg).items()}
    return init_lora_arrays(plan_injection(modules, lora_target_config(targets(cfg))), SEED, b_std)


def token_rows(vocab: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random token ids (seeded numpy), the same in every process."""
    return np.random.default_rng(seed).integers(0, vocab, size=shape, dtype=np.int64)


class Ours:
    """``backends.torch`` / ``backends.jittor``: ``from_pretrained``, ``inject_lora``, ``train_step``,
    greedy ``beam_search`` (beam 1, KV cache, unmerged LoRA)."""

    def __init__(self, name: str, ckpt: Path, lora_file: Path, trainable: bool, method: str = "lora",
                 target_modules: tuple[str, ...] = TARGETS):
        from safetensors.numpy import load_file

        import lora_core
        from lora_core.train.optim import AdamWConfig

        self.bk = bk = lora_core.get_backend(name)
        self.model = bk.from_pretrained(ckpt, quantize="nf4") if method.startswith("qlora") else bk.from_pretrained(ckpt)
        if not method.startswith("full"):
            bk.inject_lora(self.model, lora_target_config(target_modules))
            self.model.load_partial(load_file(lora_file))
        bk.set_grad_checkpoint(self.model, method.endswith("-gc"))
        if trainable:
            self.opt = bk.AdamW(bk.trainable_parameters(self.model), AdamWConfig())

    def memory_parts(self) -> dict[str, float]:
        """Bytes of the weights (every parameter and buffer, as stored: 4-bit codes and their
        scales for a QLoRA base), of the gradients and of AdamW's two fp32 moments (one per
        trainable weight each, in both backends' AdamW)."""
        trainable = sum(_numel(p) for p in self.bk.trainable_parameters(self.model).values())
        return {"weights": _stored_bytes(self.model), "gradients": 4.0 * trainable, "optimizer": 8.0 * trainable}

    def prepare(self, rows: np.ndarray):
        from lora_core.data.batching import collate

        return collate([(list(r[:1]), list(r[1:])) for r in rows.tolist()])  # inputs r[:-1], targets r[1:]

    def train_step(self, batch) -> float:
        return float(self.bk.train_step(self.model, self.opt, [batch], LR)["loss"])

    def greedy(self, prompts: np.ndarray, n: int) -> list[list[int]]:
        from lora_core.generate.beam import BeamConfig

        cfg = BeamConfig(beam=1, max_new_tokens=n, no_repeat_ngram_size=0, stop_ids=())
        out = self.bk.beam_search(self.model, prompts.tolist(), cfg, batch_size=len(prompts))
        return [[int(t) for t in o] for o in out]


class HFPeft:
    """``AutoModelForCausalLM.from_pretrained`` (float32, default attention) + ``peft`` LoRA with
    ours' initial values copied in; ``torch.optim.AdamW`` with ours' settings; ``generate``."""

    def __init__(self, ckpt: Path, lora_file: Path, trainable: bool, method: str = "lora",
                 target_modules: tuple[str, ...] = TARGETS):
        import warnings

        import peft
        import torch
        import transformers
        from safetensors.numpy import load_file

        from lora_core.train.optim import AdamWConfig

        warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notes
        transformers.utils.logging.disable_progress_bar()
        self.torch = torch
        gc = method.endswith("-gc")
        kw = {}
        if method.startswith("qlora"):
            kw = {"quantization_config": transformers.BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.float32), "device_map": "cpu"}
        model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, **kw)
        self.attn_implementation = model.config._attn_implementation
        model.generation_config.eos_token_id = None  # run every new token, as ours with stop_ids=()
        gc_kwargs = {"use_reentrant": False}
        if method.startswith("qlora"):
            model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=gc,
                                                         gradient_checkpointing_kwargs=gc_kwargs)
        elif gc:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)
        if method.startswith("full"):
            self.model = model
        else:
            lcfg = peft.LoraConfig(r=R, lora_alpha=int(ALPHA), lora_dropout=0.0, target_modules=list(target_modules))
            self.model = peft.get_peft_model(model, lcfg)
            self._load_lora(load_file(lora_file))
        if trainable:
            c = AdamWConfig()
            params = [p for p in self.model.parameters() if p.requires_grad]
            self.opt = torch.optim.AdamW(params, lr=LR, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay)

    def memory_parts(self) -> dict[str, float]:
        """Bytes of every parameter and buffer as stored (bitsandbytes' packed codes and quant
        state for a 4-bit base), of the trainable parameters' gradients, and of the tensors in
        ``torch.optim.AdamW``'s state (measured after the steps)."""
        trainable = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        state = sum(t.numel() * t.element_size() for st in self.opt.state.values() for t in st.values()
                    if isinstance(t, self.torch.Tensor) and t.dim() > 0)  # fmt: skip
        return {"weights": _stored_bytes(self.model), "gradients": float(trainable), "optimizer": float(state)}

    def _load_lora(self, values: dict) -> None:
        torch = self.torch
        with torch.no_grad():
            lora = {n: p for n, p in self.model.named_parameters() if "lora_" in n}
            names = {_our_name(n): n for n in lora}
            if set(names) != set(values):
                raise RuntimeError(f"peft LoRA names differ from ours: {sorted(set(names) ^ set(values))[:4]}")
            for ours, theirs in names.items():
                lora[theirs].copy_(torch.from_numpy(values[ours]))

    def prepare(self, rows: np.ndarray):
        return self.torch.from_numpy(rows[:, :-1].copy()), self.torch.from_numpy(rows[:, 1:].copy())

    def train_step(self, batch) -> float:
        import torch.nn.functional as F

        ids, targets = batch
        self.model.train()
        logits = self.model(input_ids=ids).logits  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def greedy(self, prompts: np.ndarray, n: int) -> list[list[int]]:
        torch = self.torch
        self.model.eval()
        ids = torch.from_numpy(prompts)
        with torch.no_grad():
            seq = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=n, eos_token_id=None, pad_token_id=0)  # fmt: skip
        return seq[:, ids.shape[1] :].tolist()


def _our_name(peft_name: str) -> str:
    """``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`` ->
    ``model.layers.0.self_attn.q_proj.lora_A``; GPT-2's ``transformer.`` prefix dropped (ours has none)."""
    name = peft_name.replace("base_model.model.", "", 1).replace(".default.weight", "")
    return name.removeprefix("transformer.")


def make_system(name: str, ckpt: Path, lora_file: Path, trainable: bool, method: str = "lora",
                target_modules: tuple[str, ...] = TARGETS):
    """``ours-torch``, ``ours-jittor`` or ``hf-peft``, set up for ``method`` (``METHODS``), LoRA on
    ``target_modules`` (``bench_shapes.targets``)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    if name == "hf-peft":
        return HFPeft(ckpt, lora_file, trainable, method, target_modules)
    return Ours(name.removeprefix("ours-"), ckpt, lora_file, trainable, method, target_modules)


def _numel(v) -> int:
    n = v.numel()
    return int(n() if callable(n) else n)


def _stored_bytes(model) -> float:
    """Bytes of every distinct parameter and buffer of a torch or jittor module."""
    seen, total = set(), 0
    tensors = list(model.named_parameters())
    named_buffers = getattr(model, "named_buffers", None)
    if callable(named_buffers):
        tensors += list(named_buffers())
    for _, t in tensors:
        if hasattr(t, "data_ptr"):  # torch: tied weights counted once
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        else:  # jittor
            total += _numel(t) * np.dtype(str(t.dtype)).itemsize
    for m in model.modules():  # jittor's 4-bit layer keeps its codes and scales outside its parameters
        for t in getattr(m, "_nf4", None) or ():
            if not hasattr(t, "data_ptr"):
                total += _numel(t) * np.dtype(str(t.dtype)).itemsize
    return float(total)
