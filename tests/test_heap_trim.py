"""ours-torch returns glibc's freed heap at every second Llama decoder layer of a training step
(``lora_core.train.heap``, ``backends.torch.llama.TrimHeap``; ``LORA_MALLOC_TRIM_EVERY=1``: every
layer): where the forward pass enters such a layer (and the last one) and where the backward pass
leaves it (where a gradient flows there: not below the first layer of LoRA, whose embedding is
frozen), never in inference; the same gradients as without. By default (``auto``) only with
activation checkpointing or a 4-bit base; ``LORA_MALLOC_TRIM=1`` trims every training step, ``0``
none, another value is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import lora_core as lc
from lora_core.data.batching import collate
from lora_core.models.llama import init_llama_weights, llama_config
from lora_core.train import heap

ROOT = Path(__file__).resolve().parents[1]


def _model(gc: bool):
    import backends.torch as bk

    cfg = llama_config("tiny-llama")
    m = bk.LlamaForCausalLM(cfg)
    m.load_weights(init_llama_weights(cfg, 0))
    bk.inject_lora(m, lc.LoRATargetConfig(r=4, alpha=8.0, dropout=0.0, seed=1, target_modules=("q_proj", "v_proj")))
    bk.set_grad_checkpoint(m, gc)
    return bk, m, cfg


def _calls_per_step(bk, m, cfg, monkeypatch):
    """Trims in one training step's forward and backward passes, and whether the gradients equal
    those of a step without trimming."""
    rng = np.random.default_rng(0)
    batch = collate([(list(rng.integers(1, cfg.vocab_size, 5)), list(rng.integers(1, cfg.vocab_size, 4))) for _ in range(2)])
    calls = []
    monkeypatch.setattr(heap, "trim", lambda: calls.append(1) or True)
    m.train()  # as train_step does (a loaded model comes in evaluation mode)
    with monkeypatch.context() as mp:
        mp.setenv("LORA_MALLOC_TRIM", "0")
        m.zero_grad(set_to_none=True)
        bk.lm_loss(m, batch, 0.0).backward()
        ref = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert not calls
    m.zero_grad(set_to_none=True)
    loss = bk.lm_loss(m, batch, 0.0)
    fwd = len(calls)
    loss.backward()
    same = all(torch.equal(p.grad, ref[n]) for n, p in m.named_parameters() if p.grad is not None)
    n = len(calls)
    with torch.no_grad():
        bk.lm_loss(m, batch, 0.0)
    m.eval()
    bk.lm_loss(m, batch, 0.0)
    m.train()
    assert len(calls) == n  # no trimming without gradients or in eval mode
    return fwd, n - fwd, same


@pytest.mark.skipif(heap._libc() is None, reason="no glibc malloc_trim")
@pytest.mark.parametrize("mode,gc,trims", [("auto", False, False), ("auto", True, True), ("1", False, True),
                                           ("on", True, True), ("0", True, False), ("off", False, False)])  # fmt: skip
def test_trims_where_wanted(mode, gc, trims, monkeypatch):
    bk, m, cfg = _model(gc)
    monkeypatch.setenv("LORA_MALLOC_TRIM", mode)
    fwd, bwd, same = _calls_per_step(bk, m, cfg, monkeypatch)
    assert cfg.num_hidden_layers == 2
    # by default (every second layer) the forward pass trims entering layer 1 (the second and the
    # last), the backward pass leaving it
    assert (fwd, bwd) == ((1, 1) if trims else (0, 0))
    assert same


@pytest.mark.skipif(heap._libc() is None, reason="no glibc malloc_trim")
@pytest.mark.parametrize("gc", [False, True])
def test_every_layer_on_request(gc, monkeypatch):
    bk, m, cfg = _model(gc)
    monkeypatch.setenv("LORA_MALLOC_TRIM", "1")
    monkeypatch.setenv("LORA_MALLOC_TRIM_EVERY", "1")
    fwd, bwd, same = _calls_per_step(bk, m, cfg, monkeypatch)
    L = cfg.num_hidden_layers
    # forward: one per layer; backward: one per layer but the first, whose input (the frozen
    # embedding's output) takes no gradient
    assert (fwd, bwd) == (L, L - 1) and same


def test_trim_points():
    def where(points, k):
        return [i for i, p in enumerate(points) if p[k]]

    eight = heap.trim_points(8, 2)
    assert where(eight, 0) == where(eight, 1) == [1, 3, 5, 7]
    five = heap.trim_points(5, 2)
    assert where(five, 0) == [1, 3, 4] and where(five, 1) == [1, 3]  # the last layer's forward entry too
    assert heap.trim_points(4, 1) == [(True, True)] * 4
    assert where(heap.trim_points(16, 4), 0) == [3, 7, 11, 15]
    assert heap.trim_points(1, 2) == [(True, False)]
    with pytest.raises(ValueError, match="stride 0"):
        heap.trim_points(4, 0)


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_bad_stride_is_refused_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv("LORA_MALLOC_TRIM_EVERY", value)
    with pytest.raises(ValueError, match=f"LORA_MALLOC_TRIM_EVERY={value!r}"):
        heap.trim_points(8)


@pytest.mark.skipif(heap._libc() is None, reason="no glibc malloc_trim")
def test_a_4bit_base_trims_by_default(tmp_path, monkeypatch):
    import json

    from safetensors.torch import save_file

    import backends.torch as bk

    cfg = llama_config("tiny-llama")
    save_file({k: torch.from_numpy(v) for k, v in init_llama_weights(cfg, 0).items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    m = bk.from_pretrained(tmp_path, quantize="nf4")
    bk.inject_lora(m, lc.LoRATargetConfig(r=4, alpha=8.0, dropout=0.0, seed=1, target_modules=("q_proj", "v_proj")))
    monkeypatch.delenv("LORA_MALLOC_TRIM", raising=False)
    fwd, bwd, same = _calls_per_step(bk, m, cfg, monkeypatch)
    assert (fwd, bwd) == (1, 1) and same


def test_switched_off_by_the_environment():
    script = "from lora_core.train import heap; print(heap.available(), heap.trim())"
    env = {**os.environ, "LORA_MALLOC_TRIM": "0"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_a_bad_mode_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("LORA_MALLOC_TRIM", "yes")
    with pytest.raises(ValueError, match="LORA_MALLOC_TRIM='yes'"):
        heap.wanted(False, False)


@pytest.mark.skipif(heap._libc() is None, reason="no glibc malloc_trim")
def test_stride_ab_runs_and_refuses_bad_strides():
    cmd = [sys.executable, "-m", "examples.lm.heap_trim_ab", "--shape", "tiny-llama", "--batch", "2", "--block", "16",
           "--steps", "2", "--gc", "--ab", "stride"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert [x.split()[:2] for x in lines[:2]] == [["every", "1"], ["every", "2"]]
    assert all("page faults per step" in x for x in lines[:2]) and "every 1 / every 2:" in lines[2]
    bad = subprocess.run(cmd + ["--strides", "1,0"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 2 and "--strides '1,0'" in bad.stderr


@pytest.mark.parametrize("mode,zero,releases", [("auto", 3, True), ("on", 3, True), ("off", 3, False),
                                                ("auto", 2, False), ("on", 0, False)])  # fmt: skip
def test_zero_3_releases_before_the_root_is_gathered(mode, zero, releases):
    assert heap.releases_before_gather(mode, zero) is releases


def test_release_rule_refuses_a_bad_mode():
    with pytest.raises(ValueError, match="heap trim mode 'sometimes'"):
        heap.releases_before_gather("sometimes", 3)


_RELEASE_SCRIPT = """
import numpy as np
from lora_core.train import heap
from lora_core.train.allocator import active
def anon():
    return int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon")).split()[1]) / 1024
xs = np.ones(200000)
# 400 arrays of 8 kB to 1.6 MB written, every second one freed: freed blocks between live ones
# (glibc serves them from its heap once a freed 1.6 MB mapping has raised its mmap threshold)
del xs
xs = [np.ones(int(n)) for n in np.random.default_rng(0).integers(1000, 200000, 400)]
del xs[::2]
before = anon()
done = heap.release()
print(active(), done, round(before - anon()))
"""


@pytest.mark.parametrize("allocator", ["glibc", "tcmalloc"])
@pytest.mark.parametrize("mode", ["auto", "0"])
def test_release_returns_freed_memory(allocator, mode):
    """``heap.release`` hands freed memory back under glibc (``malloc_trim``) and tcmalloc
    (``MallocExtension_ReleaseFreeMemory``): 400 arrays of 8 kB to 1.6 MB, every second one
    freed (about 160 MB between live ones); nothing with ``LORA_MALLOC_TRIM=0``."""
    from lora_core.train import allocator as alloc

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["LORA_MALLOC_TRIM"] = mode
    if allocator == "tcmalloc":
        lib = alloc.find_tcmalloc()
        if lib is None:
            pytest.skip("tcmalloc is not installed")
        env = alloc.preload_env(env, lib)
    out = subprocess.run([sys.executable, "-c", _RELEASE_SCRIPT], capture_output=True, text=True, cwd=ROOT, env=env,
                         check=True, timeout=120).stdout.split()  # fmt: skip
    assert out[0] == allocator
    if mode == "0":
        assert out[1] == "False" and int(out[2]) < 20
    else:
        assert out[1] == "True" and int(out[2]) >= 40, out


_ZERO_STEP_SCRIPT = """
import sys
import numpy as np, torch.distributed as dist
import lora_core as lc
import backends.torch as bk
from backends.torch import distributed as bd
from lora_core.data.batching import collate
from lora_core.models.llama import init_llama_weights, llama_config
from lora_core.train import heap
from lora_core.train.optim import AdamWConfig
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)  # no port to race for
cfg = llama_config("tiny-llama")
m = bk.LlamaForCausalLM(cfg)
m.load_weights(init_llama_weights(cfg, 0))
bk.inject_lora(m, lc.LoRATargetConfig(r=4, alpha=8.0, dropout=0.0, seed=1, target_modules=("q_proj", "v_proj")))
w = bd.data_parallel(m, "lm", int(sys.argv[1]))
opt = bd.parallel_adamw(w, bk.trainable_parameters(m), AdamWConfig())
events = []
heap.release = lambda: events.append("release") or True
m.model.embed_tokens.register_forward_pre_hook(lambda *a: events.append("forward"))
rng = np.random.default_rng(0)
for _ in range(2):
    batch = collate([(list(rng.integers(1, cfg.vocab_size, 5)), list(rng.integers(1, cfg.vocab_size, 4))) for _ in range(2)])
    bd.parallel_train_step(w, opt, [batch], [1.0], 1e-3)
dist.destroy_process_group()
print(" ".join(events))
"""


@pytest.mark.parametrize("zero,mode,events", [("3", "auto", "release forward release forward"),
                                              ("3", "0", "forward forward"), ("2", "auto", "forward forward")])  # fmt: skip
def test_a_zero_3_step_releases_memory_before_its_forward(zero, mode, events, tmp_path):
    """``parallel_train_step`` under ZeRO-3 calls ``heap.release`` before each forward pass
    (where FSDP2 gathers the root unit), not under stage 2 or with ``LORA_MALLOC_TRIM=0``
    (one gloo rank, FSDP2, a tiny Llama with LoRA, two steps)."""
    env = {**os.environ, "LORA_MALLOC_TRIM": mode, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _ZERO_STEP_SCRIPT, zero, str(tmp_path / "store")], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == events
