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
  ``gradient_checkpointing_enable``, non-reentrant, as the studies run it);
- ``-z2``, ``-z3``: ZeRO stage 2 or 3 over the ranks of the job the worker runs in (the bench
  starts it with ``torchrun`` or ``mpirun``): ours through the backend's data-parallel contract
  (``data_parallel(model, "lm", zero)``, ``parallel_adamw``, ``parallel_train_step``: FSDP2 in
  torch, the MPI-sharded AdamW in jittor, which refuses stage 3 by name); transformers + peft on
  PyTorch FSDP2 ``fully_shard`` with the same units (each decoder layer, then the root; stage 2:
  the frozen base ignored and no resharding after the forward, as DeepSpeed's ZeRO-2 keeps frozen
  weights whole; stage 3: every parameter sharded), or on DeepSpeed (``--hf-zero-engine
  deepspeed``: ``deepspeed.initialize`` with the same torch AdamW, as the studies ran ZeRO). Each
  rank trains on its own ``batch`` rows;
- ``-dp``: data parallel over the job's ranks without sharding: ours through the same contract
  at stage 0 (DDP with its gradients as views of its buckets in torch, the MPI all-reduce in
  jittor), transformers + peft in ``DistributedDataParallel`` with its defaults, as
  transformers' ``Trainer`` runs it (the planner's ``System.dp_grad_copies``).

A method name is ``BASE[-dp|-zSTAGE][-gc]`` (``lora_core.plan.memory.bench_method``): 24 names, of
which the studies' table uses 13 (full; LoRA and QLoRA plain, ``-gc``, ``-z2``, ``-z3``,
``-z3-gc``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lora_core.plan.memory import BENCH_METHODS, bench_method, bench_ranked

from .bench_shapes import LLAMA_TARGETS, projections, targets

TARGETS = LLAMA_TARGETS
METHODS = BENCH_METHODS
HF_ZERO_ENGINES = ("fsdp2", "deepspeed")  # what shards hf-peft's ZeRO rows (--hf-zero-engine)
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


def exact_4bit_inference(model) -> None:
    """Keep bitsandbytes 0.50's ``Linear4bit`` on its float32 NF4 path in inference: in eval mode
    without gradients, on a CPU with AVX512-BF16, it repacks its weight for a bfloat16 gemv kernel
    (``_convert_weight_packed_for_cpu``: absmax rounded to bfloat16, 1.3e-3 x scale off the float32
    logits, and a failure on widths below its block, as tiny-llama's 32). The reference is the
    NF4 computation it trains with, the one ours reproduces."""
    import bitsandbytes as bnb

    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False


def bnb_dequantize_exact(width: int, blocksize: int = 64) -> bool:
    """Whether bitsandbytes' CPU ``dequantize_4bit`` gives the NF4 weights of rows ``width`` wide
    (checked against ``lora_core.quant.nf4`` on the codes bitsandbytes made itself). bitsandbytes
    0.50.2's AVX512 kernel scales each row's blocks from its start, so on a CPU with AVX512 a
    width that is even but not a multiple of the block (tiny-llama's 32) dequantizes wrong (codes
    right, max error 1.5 on a randn weight; ours 0.31); other widths and other CPUs are right."""
    import numpy as np
    import torch
    from bitsandbytes import functional as bf

    from lora_core.quant import nf4

    w = torch.from_numpy(np.random.default_rng(0).standard_normal((4, width), dtype=np.float32))
    q, state = bf.quantize_4bit(w, blocksize=blocksize, quant_type="nf4", compress_statistics=False)
    ours = nf4.dequantize_nf4(nf4.quantize_nf4(w.numpy(), blocksize=blocksize, double_quant=False)).reshape(w.shape)
    return bool(np.array_equal(bf.dequantize_4bit(q, state).numpy(), ours))


class Ours:
    """``backends.torch`` / ``backends.jittor``: ``from_pretrained``, ``inject_lora``, ``train_step``,
    greedy ``beam_search`` (beam 1, KV cache, unmerged LoRA)."""

    def __init__(self, name: str, ckpt: Path, lora_file: Path, trainable: bool, method: str = "lora",
                 target_modules: tuple[str, ...] = TARGETS, device: str = "cpu", precision: str = "fp32"):
        from safetensors.numpy import load_file

        import lora_core
        from lora_core.train.optim import AdamWConfig

        base, self.zero, gc = bench_method(method)
        self.ranked = bench_ranked(method)
        self.bk = bk = lora_core.get_backend(name)
        self.model = bk.from_pretrained(ckpt, quantize="nf4") if base == "qlora" else bk.from_pretrained(ckpt)
        if base != "full":
            bk.inject_lora(self.model, lora_target_config(target_modules))
            self.model.load_partial(load_file(lora_file))
        bk.to_device(self.model, device)
        bk.set_precision(self.model, precision)
        bk.set_grad_checkpoint(self.model, gc)
        self.world = 1
        if trainable and self.ranked:  # the order of the trainer's: shard, then the optimizer of the shards
            from lora_core.train.distributed import start_job

            self.world = start_job(bk).world.size
            self.wrapper = bk.data_parallel(self.model, "lm", self.zero)
            self.opt = bk.parallel_adamw(self.wrapper, bk.trainable_parameters(self.model), AdamWConfig())
        elif trainable:
            self.opt = bk.AdamW(bk.trainable_parameters(self.model), AdamWConfig())

    def memory_parts(self) -> dict[str, float]:
        """Bytes of the weights (every parameter and buffer, as stored on this rank: 4-bit codes
        and their scales for a QLoRA base, a ZeRO-3 shard), of the gradients and of AdamW's two
        fp32 moments (one per trainable weight each, in both backends' AdamW; this rank's share
        of what its ZeRO stage shards: torch's FSDP2 shards both at stage 2, jittor's stage 2 the
        moments only)."""
        trainable = sum(_numel(p) for p in self.bk.trainable_parameters(self.model).values())
        local = _local_numel(self.bk.trainable_parameters(self.model).values())  # FSDP2's shards
        moments = local if self.zero and self.bk.NAME == "torch" else trainable / (self.world if self.zero else 1)
        return {"weights": _stored_bytes(self.model), "gradients": 4.0 * local, "optimizer": 8.0 * moments}

    def prepare(self, rows: np.ndarray):
        from lora_core.data.batching import collate

        return collate([(list(r[:1]), list(r[1:])) for r in rows.tolist()])  # inputs r[:-1], targets r[1:]

    def train_step(self, batch) -> float:
        """One update; the loss of this rank's rows (over several processes its share of the job's
        mean: the ranks' values sum to it)."""
        if self.ranked:
            out = self.bk.parallel_train_step(self.wrapper, self.opt, [batch], [1.0 / self.world], LR)
            return float(out["loss"])
        return float(self.bk.train_step(self.model, self.opt, [batch], LR)["loss"])

    def greedy(self, prompts: np.ndarray, n: int) -> list[list[int]]:
        from lora_core.generate.beam import BeamConfig

        cfg = BeamConfig(beam=1, max_new_tokens=n, no_repeat_ngram_size=0, stop_ids=())
        out = self.bk.beam_search(self.model, prompts.tolist(), cfg, batch_size=len(prompts))
        return [[int(t) for t in o] for o in out]


class HFPeft:
    """``AutoModelForCausalLM.from_pretrained`` (float32, default attention) + ``peft`` LoRA with
    ours' initial values copied in; ``torch.optim.AdamW`` with ours' settings; ``generate``.
    ``precision`` bf16/fp16: the forward pass under ``torch.autocast``, as ours' ``set_precision``."""

    def __init__(self, ckpt: Path, lora_file: Path, trainable: bool, method: str = "lora",
                 target_modules: tuple[str, ...] = TARGETS, zero_engine: str = "fsdp2", device: str = "cpu",
                 precision: str = "fp32"):
        import warnings

        import peft
        import torch
        import transformers
        from safetensors.numpy import load_file

        from lora_core.train.optim import AdamWConfig

        warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notes
        transformers.utils.logging.disable_progress_bar()
        from backends.torch.precision import DTYPES
        from lora_core.train.precision import check_precision

        self.torch, self.device = torch, torch.device(device)
        self.autocast_dtype = DTYPES.get(check_precision(precision))  # None: fp32
        base, self.zero, gc = bench_method(method)
        ranked = bench_ranked(method)
        kw = {}
        if base == "qlora":
            kw = {"quantization_config": transformers.BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.float32), "device_map": str(self.device)}
        model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, **kw)
        if base != "qlora":
            model.to(self.device)
        else:  # bitsandbytes' exact NF4 path in inference too (see exact_4bit_inference)
            exact_4bit_inference(model)
        self.attn_implementation = model.config._attn_implementation
        model.generation_config.eos_token_id = None  # run every new token, as ours with stop_ids=()
        gc_kwargs = {"use_reentrant": False}
        if base == "qlora":
            model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=gc,
                                                         gradient_checkpointing_kwargs=gc_kwargs)
        elif gc:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)
        if base == "full":
            self.model = model
        else:
            lcfg = peft.LoraConfig(r=R, lora_alpha=int(ALPHA), lora_dropout=0.0, target_modules=list(target_modules))
            self.model = peft.get_peft_model(model, lcfg)
            self._load_lora(load_file(lora_file))
        self.world, self.engine, self.ddp = 1, None, None
        if zero_engine not in HF_ZERO_ENGINES:
            raise ValueError(f"hf-peft's ZeRO engine must be one of {HF_ZERO_ENGINES}, got {zero_engine!r}")
        if trainable and self.zero and zero_engine == "fsdp2":
            self.world = _fsdp2(self.model, self.zero)
        elif trainable and ranked:  # -dp
            self.ddp, self.world = _ddp(self.model)
        if trainable:  # after fully_shard: an optimizer of the unsharded parameters would train nothing
            c = AdamWConfig()
            params = [p for p in self.model.parameters() if p.requires_grad]
            self.opt = torch.optim.AdamW(params, lr=LR, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay)
        if trainable and self.zero and zero_engine == "deepspeed":
            self.engine, self.opt, self.world = _deepspeed(self.model, self.opt, self.zero)

    def memory_parts(self) -> dict[str, float]:
        """Bytes of every parameter and buffer as stored (bitsandbytes' packed codes and quant
        state for a 4-bit base), of the trainable parameters' gradients, and of the tensors in
        ``torch.optim.AdamW``'s state (measured after the steps). Under DeepSpeed, whose partitions
        are not the modules' tensors: each rank's share of the weights (stage 3), gradients and
        two fp32 moments by ZeRO's arithmetic."""
        if self.engine is not None:
            numel = sum(getattr(p, "ds_numel", None) or p.numel() for p in self.model.parameters())
            trained = sum(getattr(p, "ds_numel", None) or p.numel() for p in self.model.parameters() if p.requires_grad)
            weights = 4.0 * numel / self.world if self.zero == 3 else _stored_bytes(self.model)
            return {"weights": weights, "gradients": 4.0 * trained / self.world, "optimizer": 8.0 * trained / self.world}
        trainable = sum(_local(p).numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        state = sum(_local(t).numel() * t.element_size() for st in self.opt.state.values() for t in st.values()
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
                lora[theirs].copy_(torch.from_numpy(values[ours]).to(lora[theirs].device))

    def _autocast(self):
        """The forward pass's autocast (ours' ``set_precision``); off for fp32."""
        return self.torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    def prepare(self, rows: np.ndarray):
        t = self.torch
        return t.from_numpy(rows[:, :-1].copy()).to(self.device), t.from_numpy(rows[:, 1:].copy()).to(self.device)

    def train_step(self, batch) -> float:
        """One update; the loss of this rank's rows (over several processes its share: FSDP2's
        reduce-scatter averages the ranks' gradients, as DDP's all-reduce, so the ranks' values sum to
        the job's mean)."""
        import torch.nn.functional as F

        ids, targets = batch
        self.model.train()
        run = self.engine or self.ddp or self.model
        with self._autocast():
            logits = run(input_ids=ids).logits  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        if self.engine is not None:  # DeepSpeed: its backward reduces (averages) the gradients, its step
            self.engine.backward(loss)
            self.engine.step()
        else:
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return loss.item() / self.world

    def greedy(self, prompts: np.ndarray, n: int) -> list[list[int]]:
        torch = self.torch
        self.model.eval()
        ids = torch.from_numpy(prompts).to(self.device)
        with torch.no_grad(), self._autocast():
            seq = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=n, eos_token_id=None, pad_token_id=0)  # fmt: skip
        return seq[:, ids.shape[1] :].tolist()


def _fsdp2(model, zero: int) -> int:
    """ZeRO ``zero`` (2 or 3) on PyTorch FSDP2 for transformers + peft, in the job ``torchrun``
    started (gloo on CPU): each decoder layer one ``fully_shard`` unit, the model the root.
    Stage 2: the trained parameters sharded, gathered once per update (no resharding after the
    forward), the frozen base ignored (whole on every rank, as DeepSpeed's ZeRO-2 keeps it);
    stage 3: every parameter sharded and regathered per layer, bitsandbytes' 4-bit weights
    excepted (packed ``Params4bit``, as DeepSpeed leaves quantized weights). The world size."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    packed = {p for p in model.parameters() if type(p).__name__ == "Params4bit"}
    ignored = packed | ({p for p in model.parameters() if not p.requires_grad} if zero == 2 else set())
    layers = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    for block in (b for ml in layers for b in ml):
        fully_shard(block, mesh=mesh, reshard_after_forward=zero == 3, ignored_params=ignored)
    fully_shard(model, mesh=mesh, reshard_after_forward=zero == 3, ignored_params=ignored)
    return dist.get_world_size()


def _ddp(model):
    """``DistributedDataParallel`` with its defaults, as transformers' ``Trainer`` wraps a model
    under ``torchrun`` (25 MB buckets, gradients beside them: ``gradient_as_bucket_view`` off;
    frozen parameters neither reduced nor bucketed), in the job ``torchrun`` started (gloo on
    CPU). The wrapped model and the world size."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return DistributedDataParallel(model), dist.get_world_size()


def _deepspeed(model, optimizer, zero: int):
    """ZeRO ``zero`` (2 or 3) on DeepSpeed for transformers + peft, in the job ``torchrun``
    started (DeepSpeed picks its CPU accelerator and gloo by itself; its first run compiles a
    small shared-memory op): ``deepspeed.initialize`` with the torch AdamW built above (DeepSpeed's
    own CPU Adam would compile for minutes), fp32, every parameter partitioned at stage 3
    (``stage3_param_persistence_threshold`` 0: by default small ones stay whole). The engine,
    its optimizer and the world size."""
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": zero, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}  # fmt: skip
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, opt, dist.get_world_size()


def _local(t):
    """This rank's part of a tensor (an FSDP2 ``DTensor``'s shard), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _local_numel(params) -> int:
    return sum(_numel(_local(p)) for p in params)


def _our_name(peft_name: str) -> str:
    """``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`` ->
    ``model.layers.0.self_attn.q_proj.lora_A``; GPT-2's ``transformer.`` prefix dropped (ours has none)."""
    name = peft_name.replace("base_model.model.", "", 1).replace(".default.weight", "")
    return name.removeprefix("transformer.")


def make_system(name: str, ckpt: Path, lora_file: Path, trainable: bool, method: str = "lora",
                target_modules: tuple[str, ...] = TARGETS, hf_zero_engine: str = "fsdp2", device: str = "cpu",
                precision: str = "fp32"):
    """``ours-torch``, ``ours-jittor`` or ``hf-peft``, set up for ``method`` (``METHODS``), LoRA on
    ``target_modules`` (``bench_shapes.targets``); ``hf_zero_engine``: what shards hf-peft's
    ZeRO rows (``HF_ZERO_ENGINES``); on ``device`` (``cpu``, ``cuda``) in ``precision``."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    if name == "hf-peft":
        return HFPeft(ckpt, lora_file, trainable, method, target_modules, hf_zero_engine, device, precision)
    return Ours(name.removeprefix("ours-"), ckpt, lora_file, trainable, method, target_modules, device, precision)


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
            t = _local(t)
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
    for _, t in tensors:  # bitsandbytes' Params4bit keeps its block scales in its quant_state, no buffer
        for scales in _quant_scales(getattr(t, "quant_state", None)):
            if scales.data_ptr() not in seen:
                seen.add(scales.data_ptr())
                total += scales.numel() * scales.element_size()
    return float(total)


def _quant_scales(qs) -> list:
    """The per-block tensors of a bitsandbytes ``QuantState``: its absmax and, with double
    quantization, the nested absmax and offset (the code tables, 16 and 256 constants, left out
    as the NF4 formula leaves them)."""
    if qs is None:
        return []
    out = [qs.absmax] + ([qs.offset] if getattr(qs, "nested", False) and qs.offset is not None else [])
    if getattr(qs, "state2", None) is not None:
        out.append(qs.state2.absmax)
    return [t for t in out if hasattr(t, "data_ptr")]
