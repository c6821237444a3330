"""ZeRO-sharded data parallelism (``--zero``) on CPU with 2 processes against one process:
torch (FSDP2 ``fully_shard``; stage 2: trained parameters' gradients and AdamW state sharded,
stage 3: every parameter) and jittor over MPI (stage 2: each rank keeps and updates the AdamW
moments of its slice). The toy set's tiny GPT-2, 20 updates with gradient accumulation,
clipping and uneven shards, validation every 10 updates (uneven evaluation batches): the loss
curve, the validation NLL and the final weights within 1e-6 of one process for LoRA (with LoRA
dropout, numpy masks) and full fine-tuning (torch stages 2 and 3, jittor stage 2) and for QLoRA
(LoRA on a 4-bit base; stage 2). Checkpoints are gathered to the usual single files (full FT:
transformers' ``model.safetensors``), so a 2-process run resumes on one process; a rank
SIGKILLed after update 13 stops the job with ``ckpt-10`` intact, and ``--resume`` on 2
processes gives the uninterrupted run's log and adapter bit for bit. The classification command
under torch ZeRO-3 (validation, then dev/test predictions from the gathered checkpoint). Jittor
refuses stage 3 by name."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from helpers import assert_close
from test_cls_train import _cli, _launcher, data  # noqa: F401  (data: a fixture)
from test_distributed import _launch, _ok, toy  # noqa: F401  (toy: a fixture)

from lora_core.formats.checkpoint import read_tensors
from lora_core.train.trainer import LATEST_FILE, read_log

STEPS, SAVE, KILL = 20, 10, 13
COMMON = ["batch_size=10", "grad_accum=2", "max_grad_norm=0.05", "warmup=2", f"save_every={SAVE}",
          f"eval_every={SAVE}", "eval_batch_size=6", "log_every=1"]  # fmt: skip
# full FT at lr 1e-2: jittor's weights drift to 1.1e-6 of one process (rounding amplified by AdamW)
LORA = [*COMMON, "lr=1e-2", "lora_dropout=0.1", "dropout_masks=numpy"]
SETTINGS = {"lora": LORA, "qlora": LORA, "full": [*COMMON, "lr=1e-3"]}
OPTIONS = {
    "lora": ["--method", "lora"],
    "qlora": ["--method", "lora", "--quantize", "nf4"],
    "full": ["--method", "full"],
}
WEIGHTS = {"lora": "adapter.safetensors", "qlora": "adapter.safetensors", "full": "model.safetensors"}
RTOL = 1e-6
CASES = [("torch", 2), ("torch", 3), ("jittor", 2)]


def _args(toy, out_dir, method, *extra):  # noqa: F811
    return ["-m", "examples.nlg.train", "--recipe", "toy", "--train", str(toy["train"]), "--valid", str(toy["valid"]),
            "--random-init", "tiny", "--vocab-size", str(toy["vocab_size"]), *OPTIONS[method], "--max-steps",
            str(STEPS), "--no-progress", "--out-dir", str(out_dir), *extra, "--set", *SETTINGS[method]]  # fmt: skip


def _log(run, kind: str, key: str) -> list[float]:
    return [x[key] for x in read_log(run / "log.jsonl") if x["kind"] == kind]


def _weights(run, method: str, step: int = STEPS) -> dict:
    return read_tensors(run / f"ckpt-{step}" / WEIGHTS[method])


@pytest.fixture(scope="module")
def runs(toy, tmp_path_factory):  # noqa: F811
    """Runs made on first use and shared by the tests: ``runs(name, method, stage)``, stage 0
    for the one-process run."""
    done = {}

    def get(name: str, method: str, stage: int):
        key = (name, method, stage)
        if key not in done:
            d = tmp_path_factory.mktemp(f"zero-{name}-{method}-{stage}") / "run"
            extra = ["--zero", str(stage)] if stage else []
            _ok(_launch(name, 2 if stage else 1, _args(toy, d, method, *extra)))
            done[key] = d
        return done[key]

    return get


def _same_as_one(tag: str, run, one, method: str) -> dict:
    """Loss curve, validation NLL and final weights of ``run`` against the one-process ``one``."""
    assert_close(f"zero 2 vs 1 process loss ({tag})", _log(run, "train", "loss"), _log(one, "train", "loss"), RTOL)
    ev, ev1 = _log(run, "eval", "valid_nll"), _log(one, "eval", "valid_nll")
    assert len(ev) == len(ev1) == STEPS // SAVE
    assert_close(f"zero 2 vs 1 process valid NLL ({tag})", ev, ev1, RTOL)
    ref, got = _weights(one, method), _weights(run, method)
    assert sorted(got) == sorted(ref)
    files = [sorted(p.name for p in (r / f"ckpt-{STEPS}").iterdir()) for r in (run, one)]
    assert files[0] == files[1]  # the one-process files, gathered
    for k in ref:
        assert_close(f"zero 2 vs 1 process {method} weights ({tag})", got[k], ref[k], RTOL)
    return got


def _resume_on_one(toy, run, tmp_path, name: str, method: str) -> dict:  # noqa: F811
    """A copy of ``run`` cut back to ``ckpt-10``, resumed on one process: its final weights."""
    cut = tmp_path / "resumed"
    shutil.copytree(run, cut)
    shutil.rmtree(cut / f"ckpt-{STEPS}")
    (cut / LATEST_FILE).write_text(f"ckpt-{SAVE}\n")
    _ok(_launch(name, 1, _args(toy, cut, method, "--resume")))
    return _weights(cut, method)


@pytest.mark.parametrize("name,stage", CASES)
def test_lora_two_sharded_processes_match_one(runs, toy, tmp_path, name, stage):  # noqa: F811
    got = _same_as_one(f"{name} zero-{stage} LoRA", runs(name, "lora", stage), runs(name, "lora", 0), "lora")
    if (name, stage) == ("torch", 2):
        res = _resume_on_one(toy, runs(name, "lora", stage), tmp_path, name, "lora")
        for k in got:
            assert_close("zero-2 LoRA run resumed on 1 process: adapter", res[k], got[k], RTOL)


@pytest.mark.parametrize("name,stage", CASES)
def test_full_ft_two_sharded_processes_match_one(runs, toy, tmp_path, name, stage):  # noqa: F811
    got = _same_as_one(f"{name} zero-{stage} full FT", runs(name, "full", stage), runs(name, "full", 0), "full")
    if (name, stage) in (("torch", 3), ("jittor", 2)):
        res = _resume_on_one(toy, runs(name, "full", stage), tmp_path, name, "full")
        for k in got:
            assert_close(f"{name} zero-{stage} full FT run resumed on 1 process: weights", res[k], got[k], RTOL)


@pytest.mark.parametrize("name,stage", [("torch", 2), ("jittor", 2)])
def test_qlora_two_sharded_processes_match_one(runs, name, stage):
    """LoRA on a 4-bit base (quantized while loading): FSDP2 leaves the 4-bit codes alone (they
    are buffers), so every rank holds them whole; the adapter is sharded as with LoRA."""
    _same_as_one(f"{name} zero-{stage} QLoRA", runs(name, "qlora", stage), runs(name, "qlora", 0), "qlora")


@pytest.mark.parametrize("name", ["torch", "jittor"])
def test_killed_rank_and_resume_under_zero_2(runs, toy, tmp_path, name):  # noqa: F811
    """The last rank SIGKILLs itself after update 13 (``--stop-after``: the other rank is ended
    by the launcher); ``ckpt-10`` stays whole and ``--resume`` on 2 processes is exact."""
    cut = tmp_path / "cut"
    r = _launch(name, 2, _args(toy, cut, "lora", "--zero", "2", "--stop-after", str(KILL)))
    assert r.returncode != 0 and "signal 9" in r.stderr.lower(), r.stderr[-3000:]
    assert (cut / LATEST_FILE).read_text().strip() == f"ckpt-{SAVE}"
    assert sorted(p.name for p in cut.iterdir() if p.name.startswith(("ckpt", "."))) == [f"ckpt-{SAVE}"]
    _ok(_launch(name, 2, _args(toy, cut, "lora", "--zero", "2", "--resume")))
    whole = runs(name, "lora", 2)
    assert _log(cut, "train", "loss") == _log(whole, "train", "loss")
    assert _log(cut, "eval", "valid_nll") == _log(whole, "eval", "valid_nll")
    a, b = _weights(whole, "lora"), _weights(cut, "lora")
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_torch_zero_3_under_bf16_autocast(toy, tmp_path):  # noqa: F811
    """``--precision bf16`` with ZeRO-3: FSDP2 gathers each layer's weights, and the frozen
    products keep the gathered float32 weight (not autocast's bf16 copy) for the backward pass
    (``backends/torch/lora.py``): 2 processes track 1 process's loss curve and adapter to bf16's
    rounding (the ranks' reduction order differs)."""
    steps = ["--max-steps", "6"]
    one, two = tmp_path / "one", tmp_path / "two"
    _ok(_launch("torch", 1, _args(toy, one, "lora", "--precision", "bf16", *steps)))
    _ok(_launch("torch", 2, _args(toy, two, "lora", "--precision", "bf16", "--zero", "3", *steps)))
    assert_close("zero-3 bf16 vs 1 process loss", _log(two, "train", "loss"), _log(one, "train", "loss"), 2e-2)
    ref, got = (read_tensors(r / "ckpt-6" / WEIGHTS["lora"]) for r in (one, two))
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert_close("zero-3 bf16 vs 1 process adapter", got[k], ref[k], 5e-2, floor=float(np.abs(ref[k]).max()))


def test_jittor_refuses_stage_3(toy, tmp_path):  # noqa: F811
    r = _launch("jittor", 2, _args(toy, tmp_path / "j3", "lora", "--zero", "3"))
    assert r.returncode != 0 and "--zero 3 (sharded parameters) is not available in the jittor backend" in (
        r.stdout + r.stderr
    )


def test_classification_command_under_torch_zero_3(data, tmp_path):  # noqa: F811
    """``examples.cls.train --zero 3`` (LoRA on a tiny DistilBERT, validation every 4 updates):
    the one-process losses, validation losses and adapter, and the same dev and test
    predictions (written by rank 0 from the gathered checkpoint: the trained model is sharded).
    The adapter is compared at its own scale (the largest |value| of any of its tensors): a
    ``lora_B`` holds only 8 AdamW steps from zero, whose elements with near-zero gradients
    AdamW's normalisation moves by the rounding of the reduce-scattered gradient (on an AMD EPYC
    6.1e-8 = 1.4e-6 of that tensor's largest value at lr 1e-2, 1.9e-6 at lr 1e-3: not the lr)."""
    args = ["--base", str(data / "base0"), "--max-steps", "8", "--set", "train.batch_size=10", "train.lr=1e-2",
            "train.log_every=1", "train.save_every=4", "train.eval_every=4", "train.eval_batch_size=10",
            "train.dropout_masks=framework", "lora.dropout=0", "train.last_batch=drop"]  # fmt: skip
    one, two = tmp_path / "one", tmp_path / "two"
    for r in (
        _cli("torch", data, one, *args),
        _cli("torch", data, two, *args, "--zero", "3", launcher=_launcher("torch")),
    ):
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert_close(
        "zero 3 vs 1 process: classification loss", _log(two, "train", "loss"), _log(one, "train", "loss"), RTOL
    )
    assert len(_log(two, "eval", "valid_loss")) == 2
    assert_close("zero 3 vs 1 process: classification valid loss", _log(two, "eval", "valid_loss"),
                 _log(one, "eval", "valid_loss"), RTOL)  # fmt: skip
    a, b = _weights(one, "lora", 8), _weights(two, "lora", 8)
    scale = max(float(np.abs(v).max()) for v in a.values())
    for k in a:
        assert_close("zero 3 vs 1 process: classification adapter", b[k], a[k], RTOL, floor=scale)
    for f in ("dev_predictions.tsv", "test_predictions.tsv"):
        assert (two / f).read_text() == (one / f).read_text()
