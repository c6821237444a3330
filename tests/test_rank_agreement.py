"""What the ranks of a job compare before training, framework-free and in each backend: the
weights' fingerprint (``weights_fingerprint``: a few values of every tensor, read where they are)
and the ZeRO stage a backend can run (``check_zero``: jittor refuses stage 3 on one process as on
several). The 2-process refusals themselves: tests/test_distributed.py."""

from __future__ import annotations

import numpy as np
import pytest

import lora_core as lc
from lora_core.train.distributed import FINGERPRINT_SAMPLES, sample_positions, weights_digest
from lora_core.train.recipes import TrainConfig
from lora_core.train.trainer import Trainer


def test_sample_positions_take_first_last_and_evenly_spaced():
    assert sample_positions(0).tolist() == [] and sample_positions(1).tolist() == [0]
    assert sample_positions(10).tolist() == list(range(10))
    p = sample_positions(10_000)
    assert len(p) == FINGERPRINT_SAMPLES and p[0] == 0 and p[-1] == 9_999 and np.all(np.diff(p) > 0)


def test_digest_sees_values_shapes_dtypes_and_names_not_order():
    a = [("w", (2, 2), "float32", np.array([1.0, 2.0])), ("b", (2,), "float32", np.array([3.0]))]
    base = weights_digest(a)
    assert weights_digest(a[::-1]) == base
    for changed in ([("w", (2, 2), "float32", np.array([1.0, 2.5])), a[1]],
                    [("w", (4,), "float32", np.array([1.0, 2.0])), a[1]],
                    [("w", (2, 2), "bfloat16", np.array([1.0, 2.0])), a[1]],
                    [("v", (2, 2), "float32", np.array([1.0, 2.0])), a[1]]):  # fmt: skip
        assert weights_digest(changed) != base


def _gpt2(backend, seed):
    cfg = lc.gpt2_config("tiny-32")
    return backend.build_model(cfg, lc.LoRAConfig(r=2, alpha=4.0), lc.init_gpt2_weights(cfg, seed))


def test_fingerprint_tells_bases_apart(backend):
    same = [backend.weights_fingerprint(_gpt2(backend, 0)) for _ in range(2)]
    assert same[0] == same[1] and len(same[0]) == 64
    assert backend.weights_fingerprint(_gpt2(backend, 1)) != same[0]


def test_fingerprint_of_a_loaded_llama_and_its_4bit_base(backend, tmp_path):
    """From a transformers checkpoint (memory-mapped views in torch) and quantized while loading:
    the same files give the same fingerprint; one changed weight row of a projection changes it."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))  # fmt: skip
    hf.save_pretrained(tmp_path / "a")
    with torch.no_grad():
        hf.model.layers[0].mlp.down_proj.weight[:, -1] += 1.0  # the last column: the last sampled value moves
    hf.save_pretrained(tmp_path / "b")
    for kw in ({}, {"quantize": "nf4"}):
        fa = [backend.weights_fingerprint(backend.from_pretrained(tmp_path / "a", **kw)) for _ in range(2)]
        fb = backend.weights_fingerprint(backend.from_pretrained(tmp_path / "b", **kw))
        assert fa[0] == fa[1] != fb, kw


def test_torch_fingerprint_reads_views_as_their_values():
    """A transposed view (as GPT-2's Conv1D weights map the checkpoint) and its contiguous copy:
    the same digest (the values by their indices, no copy of the tensor)."""
    import torch

    bt = lc.get_backend("torch")
    w = torch.arange(12.0).reshape(3, 4)
    view, copy = torch.nn.Linear(3, 4, bias=False), torch.nn.Linear(3, 4, bias=False)
    view.weight = torch.nn.Parameter(w.t(), requires_grad=False)  # (4, 3), not contiguous
    copy.weight = torch.nn.Parameter(w.t().contiguous(), requires_grad=False)
    assert not view.weight.is_contiguous()
    assert bt.weights_fingerprint(view) == bt.weights_fingerprint(copy)


def test_jittor_refuses_stage_3_on_one_process_too(tmp_path):
    bj = lc.get_backend("jittor")
    with pytest.raises(ValueError, match="--zero 3 .sharded parameters. is not available in the jittor backend"):
        bj.check_zero(3)
    lc.get_backend("torch").check_zero(3)  # torch runs it (FSDP2)
    cfg = TrainConfig(batch_size=2, max_steps=1, zero=3)
    with pytest.raises(ValueError, match="is not available in the jittor backend"):
        Trainer(bj, _gpt2(bj, 0), cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
