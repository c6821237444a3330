"""ZeRO-sharded data parallelism (``--zero``) on CPU with 2 processes against one process:
torch (FSDP2 ``fully_shard``; stage 2: trained parameters' gradients and AdamW state sharded,
stage 3: every parameter) and jittor over MPI (stage 2: each rank keeps and updates the AdamW
moments of its slice). LoRA on the toy set's tiny GPT-2, 12 updates, gradient accumulation,
clipping, LoRA dropout (numpy masks) and uneven shards; no validation (torch ZeRO refuses it for
now, tested). Checkpoints are gathered to the usual single files, so the 2-process run resumes
on one process. Jittor refuses stage 3 by name."""

from __future__ import annotations

import pytest
from helpers import assert_close
from test_distributed import _adapter, _launch, _losses, _ok, toy  # noqa: F401  (toy: a fixture)

STEPS = 12
SETTINGS = ["batch_size=10", "grad_accum=2", "max_grad_norm=0.05", "lr=1e-2", "warmup=2", "save_every=6",
            "eval_every=0", "log_every=1", "lora_dropout=0.1", "dropout_masks=numpy"]


def _args(toy, out_dir, *extra):  # noqa: F811
    return ["-m", "examples.nlg.train", "--recipe", "toy", "--train", str(toy["train"]), "--random-init", "tiny",
            "--vocab-size", str(toy["vocab_size"]), "--max-steps", str(STEPS), "--no-progress", "--out-dir",
            str(out_dir), *extra, "--set", *SETTINGS]  # fmt: skip


@pytest.fixture(scope="module")
def one(toy, tmp_path_factory):  # noqa: F811
    """The one-process run of each backend, keyed by name."""
    out = {}
    for name in ("torch", "jittor"):
        d = tmp_path_factory.mktemp(f"zero-one-{name}")
        _ok(_launch(name, 1, _args(toy, d / "run")))
        out[name] = d / "run"
    return out


@pytest.mark.parametrize("name,stage", [("torch", 2), ("torch", 3), ("jittor", 2)])
def test_two_sharded_processes_match_one(toy, one, tmp_path, name, stage):  # noqa: F811
    run = tmp_path / "two"
    _ok(_launch(name, 2, _args(toy, run, "--zero", str(stage))))
    tag = f"{name} zero-{stage}"
    assert_close(f"zero 2 vs 1 process loss ({tag})", _losses(run), _losses(one[name]), 1e-6)
    ref = _adapter(one[name], STEPS)
    got = _adapter(run, STEPS)
    assert set(got) == set(ref)
    for k in ref:
        assert_close(f"zero 2 vs 1 process adapter ({tag})", got[k], ref[k], 1e-5)
    if name == "torch" and stage == 2:
        # the gathered checkpoint of update 6 resumes on one process, to the same end
        import shutil

        cut = tmp_path / "resumed"
        shutil.copytree(run, cut)
        shutil.rmtree(cut / f"ckpt-{STEPS}")
        (cut / "latest").write_text("ckpt-6\n")
        _ok(_launch(name, 1, _args(toy, cut, "--resume")))
        for k in ref:
            assert_close("zero-2 run resumed on 1 process: adapter", _adapter(cut, STEPS)[k], got[k], 1e-5)


def test_refusals(toy, tmp_path):  # noqa: F811
    r = _launch("jittor", 2, _args(toy, tmp_path / "j3", "--zero", "3"))
    assert r.returncode != 0 and "--zero 3 (sharded parameters) is not available in the jittor backend" in (
        r.stdout + r.stderr)
    args = _args(toy, tmp_path / "v", "--zero", "2", "--valid", str(toy["valid"]))
    args[args.index("eval_every=0")] = "eval_every=6"
    r = _launch("torch", 2, args)
    assert r.returncode != 0 and "validation during a torch ZeRO run" in (r.stdout + r.stderr)
