"""``--device`` and ``--grad-checkpoint`` (issue 8): the device option and its errors, placement
in both backends, checkpoints that cross devices, activation checkpointing exact against the
plain step (framework dropout and numpy parity masks). GPU tests are marked ``gpu``."""

import dataclasses
import gc
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import MEASURED

import lora_core as lc
from lora_core.data.batching import collate
from lora_core.device import parse_device, resolve_device
from lora_core.formats.checkpoint import read_tensors
from lora_core.lora.dropout import NumpyDropout
from lora_core.train.optim import AdamWConfig
from lora_core.train.recipes import TrainConfig
from lora_core.train.trainer import read_log, train

ROOT = Path(__file__).resolve().parents[1]


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _pairs(n=32, V=500, seed=0):
    rng = np.random.default_rng(seed)
    ctx = [rng.integers(1, V, rng.integers(5, 12)).tolist() for _ in range(n)]
    return [(c, [(t * 7 + 3) % V for t in c[:5]]) for c in ctx]


def test_device_strings():
    assert [parse_device(s) for s in ("auto", "cpu", "cuda", "cuda:1", " CUDA:0 ")] == [
        ("auto", None), ("cpu", None), ("cuda", None), ("cuda", 1), ("cuda", 0)]
    for bad in ("gpu", "cuda:", "cpu:0", "cuda:x", 3):
        with pytest.raises(ValueError, match=r"is not a device; choose one of auto, cpu, cuda, cuda:N"):
            parse_device(bad, "--device")
    assert resolve_device("auto", 0, "torch") == "cpu" and resolve_device("auto", 2, "torch") == "cuda:0"
    assert resolve_device("cuda", 2, "torch") == "cuda:0" and resolve_device("cuda:1", 2, "torch") == "cuda:1"
    with pytest.raises(ValueError, match=r"device='cuda': the torch backend sees no CUDA GPU here \(why\); choose one"):
        resolve_device("cuda", 0, "torch", "why")
    with pytest.raises(ValueError, match=r"sees 2 GPU\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2", 2, "torch")


@pytest.mark.skipif(_has_cuda(), reason="checks the no-GPU errors")
def test_to_device_without_a_gpu(backend):
    cfg = lc.gpt2_config("tiny-32")
    model = backend.build_model(cfg, None, lc.init_gpt2_weights(cfg))
    assert backend.to_device(model, "auto") == "cpu" and backend.to_device(model, "cpu") == "cpu"
    with pytest.raises(ValueError, match=f"the {backend.NAME} backend sees no CUDA GPU here"):
        backend.to_device(model, "cuda")
    assert backend.peak_gpu_mb(model) is None
    if backend.NAME == "jittor":
        with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=1"):
            backend.to_device(model, "cuda:1")


def _resume_run(backend, tmp_path, first: str, then: str, tc: TrainConfig) -> tuple[dict, dict]:
    """Train 8 updates on ``first`` (checkpoints at 4 and 8); in a copy of the run, resume from
    ckpt-4 with a fresh model placed on ``then``; both runs' ckpt-8 adapters."""
    cfg = lc.gpt2_config("tiny-32")

    def model_on(device):
        model = backend.build_model(cfg, tc.lora_config(), lc.init_gpt2_weights(cfg, 0))
        backend.to_device(model, device)
        return model

    full, cut = tmp_path / "full", tmp_path / "cut"
    train(backend, model_on(first), _pairs(), None, tc, full, progress=False)
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "ckpt-8")
    train(backend, model_on(then), _pairs(), None, tc, cut, resume_from=cut / "ckpt-4", progress=False)
    return tuple(read_tensors(d / "ckpt-8" / "adapter.safetensors") for d in (full, cut))


def test_checkpoint_trained_on_cpu_resumes_with_device_auto(backend, tmp_path):
    """Checkpoints are numpy: a run placed with device 'cpu' resumed by a model placed with
    'auto' (the same code path as GPU -> CPU) ends with the uninterrupted run's adapter."""
    tc = TrainConfig(batch_size=4, max_steps=8, lr=1e-2, warmup=2, seed=0, eval_every=0, save_every=4, log_every=1,
                     dropout_masks="numpy")
    a, b = _resume_run(backend, tmp_path, "cpu", "auto", tc)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[n], b[n]) for n in a)


def _loss_and_grads(bt, model, batch, masks):
    opt = bt.AdamW(bt.trainable_parameters(model), AdamWConfig())
    bt.manual_seed(123)
    if masks is not None:
        masks.reseed(0)
    model.train()
    loss = bt.lm_loss(model, batch, 0.1)
    opt.backward(loss)
    grads = opt.grads_numpy()
    opt.zero_grad()
    return loss.item(), grads


@pytest.mark.parametrize("masks", ["framework", "numpy"])
def test_grad_checkpoint_is_exact(masks):
    bt = lc.get_backend("torch")
    cfg = lc.gpt2_config("tiny", embd_pdrop=0.1, attn_pdrop=0.1, resid_pdrop=0.1)
    tc = TrainConfig(lora_dropout=0.2, seed=0)
    model = bt.build_model(cfg, tc.lora_config(), lc.init_gpt2_weights(cfg, 0))
    rng = np.random.default_rng(1)  # B != 0, so that every LoRA tensor has a gradient
    model.load_partial({n: 0.1 * rng.standard_normal(tuple(p.shape)).astype(np.float32)
                        for n, p in bt.trainable_parameters(model).items()})
    src = NumpyDropout(5) if masks == "numpy" else None
    bt.set_dropout_source(model, src)
    batch = collate(_pairs(6), max_len=cfg.n_positions)
    calls = []
    model.h[0].register_forward_pre_hook(lambda *a: calls.append(1))  # (recomputation stops early: no post-hook)
    plain = _loss_and_grads(bt, model, batch, src)
    assert len(calls) == 1
    bt.set_grad_checkpoint(model, True)
    ckpt = _loss_and_grads(bt, model, batch, src)
    assert len(calls) == 3  # forward + recomputation in the backward pass
    assert abs(plain[0] - ckpt[0]) <= 1e-6 * abs(plain[0])
    worst = max(np.abs(ckpt[1][n] - g).max() / np.abs(g).max() for n, g in plain[1].items())
    MEASURED[f"grad checkpoint vs plain step, LoRA grads ({masks} dropout masks)"] = float(worst)
    for n, g in plain[1].items():
        assert np.abs(g).max() > 0
        np.testing.assert_allclose(ckpt[1][n], g, rtol=0, atol=1e-6 * np.abs(g).max(), err_msg=n)
    bt.set_grad_checkpoint(model, False)  # and dropout really differs between seeds (a test that can fail)
    bt.manual_seed(7)
    assert bt.lm_loss(model.train(), batch, 0.1).item() != plain[0]


def test_jittor_grad_checkpoint_switch():
    """jittor checkpoints too (issue 22): the switch sets and clears the model's flag; the
    steps themselves are compared in tests/test_grad_checkpoint.py."""
    bj = lc.get_backend("jittor")
    cfg = lc.gpt2_config("tiny-32")
    model = bj.build_model(cfg, None, lc.init_gpt2_weights(cfg))
    bj.set_grad_checkpoint(model, True)
    assert model.grad_checkpoint is True
    bj.set_grad_checkpoint(model, False)
    assert model.grad_checkpoint is False


def _cli(args):
    """The train CLI through ``sh`` (a SIGKILLed child must not be this process's child: see
    tests/test_train.py ``_run_cli``)."""
    cmd = ["sh", "-c", '"$@"; exit $?', "sh", sys.executable, "-m", "examples.nlg.train", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_cli_options_do_not_block_resume(tmp_path):
    """--device and --grad-checkpoint change no result: a resume may change them; --precision does."""
    from lora_core.data.nlg import write_jsonl_atomic

    data = tmp_path / "train.jsonl"
    write_jsonl_atomic(data, [{"context": c, "completion": t} for c, t in _pairs()])
    base = ["--backend", "torch", "--recipe", "toy", "--train", str(data), "--random-init", "tiny-32",
            "--no-progress", "--out-dir", str(tmp_path / "run"), "--set", "batch_size=4", "save_every=2"]
    r = _cli(base + ["--max-steps", "4", "--device", "cpu", "--grad-checkpoint", "--stop-after", "3"])
    assert r.returncode == 128 + 9, r.stderr
    r = _cli(base + ["--max-steps", "4", "--device", "auto", "--resume"])
    assert r.returncode == 0, r.stderr
    recs = read_log(tmp_path / "run" / "log.jsonl")
    assert [x["step"] for x in recs if x["kind"] == "train"] == [1, 2, 3, 4]
    assert all("peak_gpu_mb" in x for x in recs if x["kind"] == "train")
    r = _cli(base + ["--max-steps", "4", "--precision", "bf16", "--resume"])
    assert r.returncode != 0 and "train.precision: saved 'fp32', now 'bf16'" in r.stderr
    fresh = [str(tmp_path / "run2") if a == str(tmp_path / "run") else a for a in base]  # a new run folder
    r = _cli(fresh + ["--max-steps", "4", "--device", "cuda:x"])
    assert r.returncode != 0 and "device='cuda:x' is not a device; choose one of auto, cpu, cuda, cuda:N" in r.stderr
    r = _cli(base + ["--precision", "fp8"])
    assert r.returncode == 2 and "invalid choice: 'fp8'" in r.stderr


class _GPUCounter:
    """A stand-in for a GPU's peak memory counter: ``peak`` (MiB) is what ``peak_gpu_mb``
    reads; a reset brings it down to ``allocated``, what is held now."""

    def __init__(self, peak: float, allocated: float):
        self.peak, self.allocated, self.resets = peak, allocated, 0

    def read(self, model):
        return self.peak

    def reset(self, model):
        self.peak, self.resets = self.allocated, self.resets + 1


def test_each_run_logs_its_own_peak_gpu_memory(backend, tmp_path, monkeypatch):
    """Issue 25: the counter is the process's (torch's ``max_memory_allocated``), so a second
    run in a process, or a run after other GPU work, logged the earlier peak; the trainer
    resets it where a run starts (counter faked: no GPU here)."""
    counter = _GPUCounter(peak=900.0, allocated=120.0)  # 900: left by earlier work in the process
    monkeypatch.setattr(backend, "peak_gpu_mb", counter.read)
    monkeypatch.setattr(backend, "reset_peak_gpu", counter.reset)
    cfg = lc.gpt2_config("tiny-32")
    tc = TrainConfig(batch_size=4, max_steps=2, lr=1e-2, warmup=0, seed=0, eval_every=0, save_every=0, log_every=1)
    for run in ("first", "second"):
        model = backend.build_model(cfg, tc.lora_config(), lc.init_gpt2_weights(cfg, 0))
        train(backend, model, _pairs(8), None, tc, tmp_path / run, progress=False)
        peaks = [x["peak_gpu_mb"] for x in read_log(tmp_path / run / "log.jsonl") if x["kind"] == "train"]
        assert peaks == [120.0, 120.0], (run, peaks)
        counter.peak = 900.0  # the next run starts after a higher peak again
    assert counter.resets == 2


def test_torch_reset_peak_gpu_resets_the_model_gpu(monkeypatch):
    """``reset_peak_gpu`` resets the counter of the model's GPU (``cuda:1`` here: faked) and
    does nothing on the CPU; ``peak_gpu_mb`` reads that GPU's."""
    import types

    import torch

    bt = lc.get_backend("torch")
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda dev=None: calls.append(("reset", dev)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev=None: calls.append(("read", dev)) or 3 * 2**20)
    on_gpu = types.SimpleNamespace(parameters=lambda: iter([types.SimpleNamespace(device=torch.device("cuda:1"))]))
    bt.reset_peak_gpu(on_gpu)
    assert bt.peak_gpu_mb(on_gpu) == 3.0
    assert calls == [("reset", torch.device("cuda:1")), ("read", torch.device("cuda:1"))]
    cfg = lc.gpt2_config("tiny-32")
    bt.reset_peak_gpu(bt.build_model(cfg, None, lc.init_gpt2_weights(cfg)))
    assert len(calls) == 2


# ----------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="no CUDA GPU")
def test_cuda_training_matches_cpu_and_checkpoints_cross(tmp_path):
    """fp32 on the GPU tracks the CPU run; the GPU checkpoint resumes on the CPU; bf16 on the
    GPU tracks fp32; peak GPU memory is logged."""
    bt = lc.get_backend("torch")
    cfg = lc.gpt2_config("tiny-32")
    tc = TrainConfig(batch_size=4, max_steps=8, lr=1e-2, warmup=2, seed=0, eval_every=0, save_every=4, log_every=1,
                     lora_dropout=0.0)

    def run(out, device, precision="fp32"):
        model = bt.build_model(cfg, tc.lora_config(), lc.init_gpt2_weights(cfg, 0))
        bt.to_device(model, device)
        train(bt, model, _pairs(), None, dataclasses.replace(tc, precision=precision), out, progress=False)
        return [x for x in read_log(out / "log.jsonl") if x["kind"] == "train"]

    cpu, gpu = run(tmp_path / "cpu", "cpu"), run(tmp_path / "gpu", "cuda")
    assert gpu[-1]["peak_gpu_mb"] > 0 and cpu[-1]["peak_gpu_mb"] is None
    np.testing.assert_allclose([x["loss"] for x in gpu], [x["loss"] for x in cpu], rtol=1e-4)
    for first, then in (("cuda", "cpu"), ("cpu", "cuda")):
        a, b = _resume_run(bt, tmp_path / f"{first}-{then}", first, then, tc)
        for n in a:  # devices round differently; Adam's first steps amplify tiny gradients' differences
            assert np.abs(a[n] - b[n]).max() <= 1e-2 * np.abs(a[n]).max(), n
    bf16 = run(tmp_path / "bf16", "cuda", "bf16")
    rel = np.abs(np.array([x["loss"] for x in bf16]) - [x["loss"] for x in gpu]) / [x["loss"] for x in gpu]
    assert 0 < rel.max() < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="no CUDA GPU")
def test_cuda_second_run_in_a_process_logs_its_own_peak(tmp_path):
    """A small run, a large one, the small one again, in one process: the last logs its own peak
    GPU memory, the first small run's (before issue 25 it logged the large run's). Not a ratio to
    the large run's: the tiny model's weights and cuBLAS's workspace dominate a small run's peak
    (measured on an H200, 2026-11-26: 66.2 MB small after large, 189.2 MB large)."""
    bt = lc.get_backend("torch")
    cfg = lc.gpt2_config("tiny", n_positions=512)

    def run(out, batch_size, length):
        tc = TrainConfig(batch_size=batch_size, max_steps=2, lr=1e-2, warmup=0, seed=0, eval_every=0, save_every=0,
                         log_every=1)
        model = bt.build_model(cfg, tc.lora_config(), lc.init_gpt2_weights(cfg, 0))
        bt.to_device(model, "cuda")
        pairs = [(c * (length // len(c) + 1))[:length] for c, _ in _pairs(2 * batch_size, V=cfg.vocab_size)]
        train(bt, model, [(c, c[:8]) for c in pairs], None, tc, out, progress=False)
        del model
        gc.collect()  # nothing of this run still allocated when the next starts
        return max(x["peak_gpu_mb"] for x in read_log(out / "log.jsonl") if x["kind"] == "train")

    first = run(tmp_path / "small-first", 2, 16)
    big, small = run(tmp_path / "big", 32, 480), run(tmp_path / "small", 2, 16)
    assert 0 < small < big and abs(small - first) <= 0.02 * first + 1.0, (first, big, small)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="no CUDA GPU")
def test_cuda_beam_scores_on_the_device_and_decodes_what_the_cpu_decodes():
    """On a GPU, beam search ranks each step on the device (scoring "auto") and replays a decode
    step captured once per shape (decode_step "auto"), and gives the CPU's host-scored eager
    beams; so does the eager step on the GPU."""
    from lora_core.generate.beam import BeamConfig

    bt = lc.get_backend("torch")
    cfg = lc.gpt2_config("tiny")
    model = bt.build_model(cfg, None, lc.init_gpt2_weights(cfg, 0))
    ctxs = [list(np.random.default_rng(i).integers(1, 999, 3 + i)) for i in range(6)]
    bc = BeamConfig(beam=4, max_new_tokens=12, stop_ids=(5, 7, 9), length_penalty=0.8, repetition_penalty=1.2,
                    min_length=3)
    cpu = bt.beam_search(model, ctxs, bc, batch_size=3)
    bt.to_device(model, "cuda")
    assert bt.beam_search(model, ctxs, bc, batch_size=3) == cpu
    assert bt.beam_search(model, ctxs, bc, batch_size=3, decode_step="eager") == cpu
    from test_beam import captured_search

    out, static = captured_search(model, ctxs, bc, 4)  # batches of 4 and 2 inputs: two shapes
    assert out == cpu and static.captures == len(static.caches) == 2
