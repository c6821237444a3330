"""fp16 loss scaling under torch ZeRO (FSDP2): each rank holds only its shard of every gradient,
so whether the scaled gradients are finite is agreed over the ranks before the update: one rank's
inf skips the update on every rank and halves every rank's scale (each rank deciding on its own
shard let the ranks' scales and weights drift apart). And the run-agreement check hashes the
source it promises to (a module move once left it hashing no file at all)."""

from __future__ import annotations

import hashlib
import os
import socket
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from backends.torch.optim import AdamW
    from lora_core.train.optim import AdamWConfig
    from lora_core.train.precision import LossScaleConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 8, bias=False)
    fully_shard(model)
    opt = AdamW(dict(model.named_parameters()), AdamWConfig(loss_scale=LossScaleConfig(init_scale=1024.0)))
    before = model.weight.to_local().clone()
    model.weight.grad = torch.distributed.tensor.DTensor.from_local(
        torch.full_like(model.weight.to_local(), float("inf") if rank == 1 else 1.0),
        model.weight.device_mesh, model.weight.placements)  # fmt: skip
    opt.step(1e-3)
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{opt.loss_scale.scale} {opt.loss_scale.skipped_steps} {int(torch.equal(before, model.weight.to_local()))}")
    dist.destroy_process_group()


def test_one_ranks_overflow_skips_the_update_on_every_rank(tmp_path):
    out = str(tmp_path / "rank")
    torch.multiprocessing.spawn(_rank, args=(_free_port(), out), nprocs=2, join=True)
    # every rank: the scale halved, one skipped update, its shard of the weight untouched
    assert [Path(f"{out}.{r}").read_text() for r in (0, 1)] == ["512.0 1 1"] * 2


def test_code_version_hashes_the_sources_of_a_run(tmp_path, monkeypatch):
    from lora_core.train import distributed

    digest = distributed.code_version("torch")
    assert digest != hashlib.sha256(b"").hexdigest() and digest != distributed.code_version("jittor")
    seen = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: seen.append(p.relative_to(ROOT).as_posix()) or real(p))
    distributed.code_version("torch")
    for f in ("lora_core/train/trainer.py", "lora_core/models/llama.py", "backends/torch/train.py",
              "examples/lm/train.py", "examples/nlg/train.py", "examples/cls/train.py"):  # fmt: skip
        assert f in seen, f
    assert not any(f.startswith("backends/jittor/") for f in seen)
