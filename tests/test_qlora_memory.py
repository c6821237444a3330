"""Quantizing while loading keeps the full-precision model out of memory (issue 23): a float32
GPT-2 or DistilBERT checkpoint of ~39 MB loaded with ``quantize="nf4"`` in a fresh process,
whose private (anonymous) resident memory, ``RssAnon`` of /proc/self/status (the memory-mapped
checkpoint's pages are file-backed and not counted), is sampled every 0.2 ms during the load.

Bound: the growth of the peak over the process's memory before the load <= the 4-bit model
(packed NF4 weights + the float32 tensors left unquantized) + a quarter of the float32 weights
(the tensor being quantized, its temporaries, the allocator's slack): 16.0 MB (GPT-2), 16.3 MB
(DistilBERT). Measured (2-core CPU, two runs): 8.4-11.9 MB in both backends; before GPT-2's Conv1D
weights were left as transposed views of the map (all of them were copied to float32 before
the first was quantized) 40.9 / 42.8 MB (torch / jittor), above the float32 weights' 39.1 MB."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lora_core.formats.hf_checkpoint import write_hf_checkpoint
from lora_core.models import distilbert as db
from lora_core.models import gpt2
from lora_core.quant.qlora import is_quantized_weight
from lora_core.train.full_ft import hf_config, hf_tensors

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")

# 12 blocks of width 256 (9.4 M quantized weights, ~39 MB float32), small vocabulary
BIG = {"gpt2": gpt2.GPT2Config(vocab_size=1024, n_positions=128, n_embd=256, n_layer=12, n_head=4),
       "distilbert": db.DistilBertConfig(vocab_size=1024, max_position_embeddings=128, dim=256, n_layers=12, n_heads=4,
                                         hidden_dim=1024)}
SMALL = {"gpt2": gpt2.GPT2Config(vocab_size=64, n_positions=16, n_embd=64, n_layer=1, n_head=2),
         "distilbert": db.DistilBertConfig(**db.PRESETS["tiny"].to_dict())}

CHILD = r"""
import gc, json, sys, threading, time

def private():  # resident anonymous memory, bytes
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

from lora_core import get_backend

bk = get_backend(sys.argv[1])
load = bk.distilbert_from_pretrained if sys.argv[2] == "distilbert" else bk.from_pretrained
m = load(sys.argv[3], quantize="nf4")  # warm-up: imports, lookup tables, first allocations
del m
gc.collect()
peak, stop = [0], []

def sample():
    while not stop:
        peak[0] = max(peak[0], private())
        time.sleep(0.0002)

base = private()
t = threading.Thread(target=sample)
t.start()
m = load(sys.argv[4], quantize="nf4")
stop.append(1)
t.join()
print(json.dumps({"growth": max(peak[0], private()) - base}))
"""


def _weights(family: str, cfg) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {n: (rng.standard_normal(s) * 0.02).astype(np.float32)
            for n, s in (gpt2.base_shapes(cfg) if family == "gpt2" else db.base_shapes(cfg)).items()}


def _write(folder: Path, family: str, cfg) -> dict[str, np.ndarray]:
    w = _weights(family, cfg)
    write_hf_checkpoint(folder, hf_config(cfg), hf_tensors(cfg, w))
    return w


def _bound(w: dict[str, np.ndarray]) -> tuple[int, int]:
    """(the bound, the float32 bytes): 4-bit model + a quarter of the float32 weights."""
    fp32 = sum(v.nbytes for v in w.values())
    q = sum(v.size for n, v in w.items() if is_quantized_weight(n))
    four_bit = q // 2 + q // 64 + 4 * (q // (64 * 256) + 1) + sum(v.nbytes for n, v in w.items()
                                                                    if not is_quantized_weight(n))
    return four_bit + fp32 // 4, fp32


def test_quantizing_while_loading_never_holds_the_float32_model(backend, tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    runs = {}
    for family in BIG:  # one process per family, side by side
        w = _write(tmp_path / f"{family}-big", family, BIG[family])
        _write(tmp_path / f"{family}-small", family, SMALL[family])
        runs[family] = _bound(w), subprocess.Popen(
            [sys.executable, "-c", CHILD, backend.NAME, family, str(tmp_path / f"{family}-small"),
             str(tmp_path / f"{family}-big")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            cwd=root)
        del w
    for family, ((bound, fp32), proc) in runs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        growth = json.loads(out.strip().splitlines()[-1])["growth"]
        print(f"{backend.NAME} {family}: private memory grew {growth / 1e6:.1f} MB loading {fp32 / 1e6:.1f} MB of "
              f"float32 weights (bound {bound / 1e6:.1f} MB)")
        assert growth <= bound, (f"{family}: {growth / 1e6:.1f} MB > {bound / 1e6:.1f} MB: the float32 weights "
                                 f"were held at once")
