"""The systems and inputs of ``examples.nlg.bench``: our backends and HF ``transformers`` +
``peft`` behind the same three calls (``prepare``, ``train_step``, ``beam``), the model
shapes, and the examples every system gets (see the bench module's docstring): E2E with
GPT-2's vocabulary for ``gpt2`` and ``tiny``; for ``demo`` (the embedded demo's model) the
demo's own toy data set and 512-token BPE, made here as the demo makes them."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

STOP_IDS = (50256, 628)
BATCH, LR, LABEL_SMOOTH, WEIGHT_DECAY, SEED = 8, 2e-4, 0.1, 0.01, 0  # BATCH: the default (--batch)
BEAM = dict(beam=10, length_penalty=0.9, no_repeat_ngram_size=4)  # + max 64 new tokens (paper)


SHAPES = ("gpt2", "tiny", "demo", "gpt2-medium", "gpt2-large")  # the last two: GPT-2's presets, for a GPU


def shape_config(name: str):
    from lora_core import gpt2_config

    if name == "demo":
        return gpt2_config("demo", vocab_size=_toy()[0].vocab_size)
    return gpt2_config(name, vocab_size=50257, n_positions=1024) if name == "tiny" else gpt2_config(name)


def stop_ids(shape: str) -> tuple[int, ...]:
    """Ids that end a generation: GPT-2's, or the toy tokenizer's for ``demo``."""
    return _toy()[0].stop_ids if shape == "demo" else STOP_IDS


_TOY: list = []


def _toy():
    """(tokenizer, records by split) of the demo's toy data set, made once per process."""
    if not _TOY:
        import tempfile

        from lora_core.data.convert import convert_e2e
        from lora_core.data.tokenizer import load_tokenizer
        from lora_core.data.toy import make_toy_dataset

        with tempfile.TemporaryDirectory() as d:
            paths = make_toy_dataset(Path(d))
            _TOY.extend([load_tokenizer(Path(d)), {s: convert_e2e(paths[s]) for s in ("train", "test")}])
    return _TOY


# ----------------------------------------------------------------------------- data


def train_examples(data_dir: Path, n: int, shape: str = "gpt2") -> list[tuple[list[int], list[int]]]:
    """The first ``n`` training examples (E2E, or the toy set for ``demo``) in a seeded
    shuffled order (paper layout ids)."""
    from lora_core.data.convert import convert_e2e
    from lora_core.data.tokenizer import encode_example, load_tokenizer

    if shape == "demo":
        tok, records = _toy()[0], _toy()[1]["train"]
    else:
        tok, records = load_tokenizer(data_dir / "gpt2-vocab"), convert_e2e(data_dir / "e2e" / "train.txt")
    order = np.random.default_rng(SEED).permutation(len(records))
    picked = [records[i] for i in np.resize(order, n)]  # wraps around if n > len(records)
    return [encode_example(tok, r["context"], r["completion"]) for r in picked]


def beam_contexts(data_dir: Path, k: int, shape: str = "gpt2") -> list[list[int]]:
    """Prompt ids (``bpe(MR) + [eos]``) of the first ``k`` unique test MRs (E2E, or the toy set)."""
    from lora_core.data.convert import convert_e2e
    from lora_core.data.nlg import group_references
    from lora_core.data.tokenizer import load_tokenizer

    if shape == "demo":
        tok, records = _toy()[0], _toy()[1]["test"]
    else:
        tok, records = load_tokenizer(data_dir / "gpt2-vocab"), convert_e2e(data_dir / "e2e" / "test.txt")
    groups = group_references(records)[:k]
    return [tok.encode(g.context) + [tok.eos_id] for g in groups]


def gen_length(tokens, stops: tuple[int, ...] = STOP_IDS) -> int:
    """Generated tokens up to and including the first stop id."""
    tokens = list(tokens)
    for i, t in enumerate(tokens):
        if t in stops:
            return i + 1
    return len(tokens)


# ----------------------------------------------------------------------------- systems


class Ours:
    """Our backend (``torch`` or ``jittor``) behind the benchmark's three calls."""

    def __init__(self, name: str, cfg, trainable: bool, stops: tuple[int, ...] = STOP_IDS, device: str = "cpu",
                 precision: str = "fp32", decode_step: str = "auto", compile: str = "off"):
        import lora_core
        from lora_core.train.optim import AdamWConfig
        from lora_core.train.precision import LossScaleConfig

        self.be, self.stops = lora_core.get_backend(name), stops
        self.decode_step = decode_step if name == "torch" else "auto"  # jittor has no captured step
        base = lora_core.init_gpt2_weights(cfg, SEED)
        self.model = self.be.build_model(cfg, lora_core.LoRAConfig(r=4, alpha=32), base, trainable=trainable)
        del base
        self.be.to_device(self.model, device)
        self.be.set_precision(self.model, precision)
        if trainable and compile != "off" and name == "torch":  # jittor has no compiled step
            self.be.set_compile(self.model, True, backend=compile)
        if trainable:
            scaling = LossScaleConfig() if precision == "fp16" else None
            self.opt = self.be.AdamW(self.be.trainable_parameters(self.model),
                                     AdamWConfig(weight_decay=WEIGHT_DECAY, loss_scale=scaling))

    def peak_gpu_mb(self) -> float | None:
        return self.be.peak_gpu_mb(self.model)

    def reset_peak_gpu(self) -> None:
        self.be.reset_peak_gpu(self.model)

    def compiled_graphs(self) -> int | None:
        """Graphs the compiled training step built (one per length bucket), ``None`` when eager."""
        compiled = getattr(self.model, "compiled_loss", None)
        return None if compiled is None else compiled.graphs

    def prepare(self, pairs):
        from lora_core.data.batching import collate

        return collate(pairs)

    def train_step(self, batch) -> float:
        return self.be.train_step(self.model, self.opt, [batch], LR, LABEL_SMOOTH, 0.0)["loss"]

    def beam(self, contexts, batch_size: int, max_new_tokens: int, min_new_tokens: int) -> list[list[int]]:
        from lora_core.generate.beam import BeamConfig

        cfg = BeamConfig(**BEAM, max_new_tokens=max_new_tokens, min_length=min(min_new_tokens, max_new_tokens),
                         repetition_penalty=1.0, stop_ids=self.stops)  # fmt: skip
        return self.be.beam_search(self.model, contexts, cfg, batch_size=batch_size, decode_step=self.decode_step)


class HFPeft:
    """``transformers`` GPT-2 + ``peft`` LoRA, used the way their documentation shows; in bf16
    or fp16 under ``torch.autocast`` (fp16 with ``torch.amp.GradScaler``)."""

    def __init__(self, cfg, trainable: bool, stops: tuple[int, ...] = STOP_IDS, device: str = "cpu",
                 precision: str = "fp32"):
        import warnings

        import peft
        import torch
        import transformers

        warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notes

        from lora_core import init_gpt2_weights
        from lora_core.device import resolve_device
        from lora_core.models.gpt2 import TRANSPOSED

        self.torch, self.stops, self.eos = torch, stops, stops[0]
        hf_cfg = transformers.GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.n_positions, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
            n_head=cfg.n_head, layer_norm_epsilon=cfg.layer_norm_epsilon, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=self.eos, eos_token_id=self.eos)  # fmt: skip
        model = transformers.GPT2LMHeadModel(hf_cfg)
        base = init_gpt2_weights(cfg, SEED)  # the same weights as ours; Conv1D stores (in, out)
        state = {"transformer." + k: torch.from_numpy(v.T if k.endswith(TRANSPOSED) else v) for k, v in base.items()}
        params = dict(model.named_parameters())
        if set(params) != set(state):
            raise RuntimeError(f"HF GPT-2 weights: names differ: {sorted(set(params) ^ set(state))}")
        with torch.no_grad():  # in place, tensor by tensor (no second copy of the model)
            for name in list(state):
                params[name].copy_(state.pop(name))
        del base
        lcfg = peft.LoraConfig(r=4, lora_alpha=32, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
        self.model = peft.get_peft_model(model, lcfg)
        self.device = resolve_device(device, torch.cuda.device_count() if torch.cuda.is_available() else 0, "hf-peft")
        self.model.to(self.device)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        kind = self.device.split(":")[0]
        self.autocast = (lambda: torch.autocast(kind, dtype=dtype)) if dtype else contextlib.nullcontext
        self.scaler = torch.amp.GradScaler(kind, enabled=precision == "fp16")
        if trainable:
            params = [p for p in self.model.parameters() if p.requires_grad]
            self.opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)

    def peak_gpu_mb(self) -> float | None:
        if not self.device.startswith("cuda"):
            return None
        return round(self.torch.cuda.max_memory_allocated(self.device) / 2**20, 1)

    def reset_peak_gpu(self) -> None:
        if self.device.startswith("cuda"):
            self.torch.cuda.reset_peak_memory_stats(self.device)

    def compiled_graphs(self) -> None:
        return None  # HF+PEFT runs eager, as its documentation shows

    def prepare(self, pairs):
        torch = self.torch
        T = max(len(c) + len(t) for c, t in pairs)
        ids = torch.full((len(pairs), T), self.eos, dtype=torch.long)
        mask = torch.zeros((len(pairs), T), dtype=torch.long)
        labels = torch.full((len(pairs), T), -100, dtype=torch.long)
        for b, (c, t) in enumerate(pairs):
            n = len(c) + len(t)
            ids[b, :n], mask[b, :n] = torch.tensor(c + t), 1
            labels[b, len(c) : n] = torch.tensor(t)
        return ids, mask, labels

    def train_step(self, batch) -> float:
        import torch.nn.functional as F

        ids, mask, labels = (t.to(self.device) for t in batch)
        self.model.train()
        with self.autocast():
            logits = self.model(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100,
                               label_smoothing=LABEL_SMOOTH)  # fmt: skip
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def beam(self, contexts, batch_size: int, max_new_tokens: int, min_new_tokens: int) -> list[list[int]]:
        from lora_core.generate.beam import left_pad

        torch = self.torch
        self.model.eval()
        out = []
        for s in range(0, len(contexts), batch_size):
            ids, mask = left_pad(contexts[s : s + batch_size], pad_id=self.eos)
            with torch.no_grad(), self.autocast():
                seq = self.model.generate(
                    input_ids=torch.from_numpy(ids).to(self.device), attention_mask=torch.from_numpy(mask).to(self.device),
                    do_sample=False,
                    num_beams=BEAM["beam"], max_new_tokens=max_new_tokens, min_new_tokens=min(min_new_tokens, max_new_tokens),
                    length_penalty=BEAM["length_penalty"],
                    no_repeat_ngram_size=BEAM["no_repeat_ngram_size"], repetition_penalty=1.0,
                    early_stopping=False, eos_token_id=list(self.stops), pad_token_id=self.eos)  # fmt: skip
            out.extend(row[ids.shape[1] :].tolist() for row in seq)
        return out


def make_system(name: str, cfg, trainable: bool, stops: tuple[int, ...] = STOP_IDS, device: str = "cpu",
                precision: str = "fp32", decode_step: str = "auto", compile: str = "off"):
    """A system by name; ``hf-peft-bf16`` is ``hf-peft`` in bf16 whatever ``precision`` says;
    ``decode_step``: our beam search's (``beam_search(..., decode_step=...)``; HF has its own);
    ``compile``: ours-torch's training step through ``torch.compile`` with this dynamo
    backend (``set_compile``), or ``off``."""
    if name.startswith("hf-peft"):
        return HFPeft(cfg, trainable, stops, device, "bf16" if name == "hf-peft-bf16" else precision)
    return Ours(name.removeprefix("ours-"), cfg, trainable, stops, device, precision, decode_step, compile)
