"""Data parallelism end to end, on CPU with 2 processes: ``torchrun`` (torch, gloo) and
``mpirun`` (jittor, MPI) runs of the train and beam CLIs against the one-process run.

Per backend: the loss sequence over 20 updates and the adapter after them within 1e-5
(relative) of one process, with LoRA dropout (shared numpy masks), gradient accumulation,
clipping and uneven shards (batches of 10 = micro-batches of 5 = shards of 3 + 2, and a last
batch of 8); a rank SIGKILLed after update 13 stops the job, and ``--resume`` on 2 processes
ends with the uninterrupted 2-process weights; the sharded beam search writes the same file
as one process; ranks started with different settings are refused on every rank. Torch only
(engine-independent code): resume on another number of processes, refusals (changed global
batch, unshardable batch, unreachable rank)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_close, toy_train_args

from lora_core.data.convert import convert
from lora_core.data.nlg import read_jsonl, write_jsonl_atomic
from lora_core.data.tokenizer import encode_file, load_tokenizer
from lora_core.data.toy import make_toy_dataset
from lora_core.formats.checkpoint import read_tensors
from lora_core.train.trainer import LATEST_FILE, read_log

ROOT = Path(__file__).resolve().parents[1]
STEPS, KILL = 20, 13
SETTINGS = [
    "batch_size=10",
    "grad_accum=2",
    "max_grad_norm=0.05",
    "lr=1e-2",
    "warmup=2",
    "save_every=10",
    "eval_every=10",
    "log_every=1",
    "lora_dropout=0.1",
]
TIMEOUT = 240  # seconds for one launcher run; a SIGKILLed rank must end its job well within it


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """48 training, 16 validation examples and 12 test MRs of the toy set."""
    d = tmp_path_factory.mktemp("toy-dp")
    paths = make_toy_dataset(d)
    tok = load_tokenizer(paths["tokenizer"])
    out = {"vocab_size": tok.vocab_size, "tokenizer": paths["tokenizer"], "test": d / "test.jsonl"}
    for split, n in (("train", 48), ("valid", 16)):
        out[split] = d / f"{split}.jsonl"
        write_jsonl_atomic(out[split], encode_file(tok, convert("e2e", paths[split])[:n]))
    write_jsonl_atomic(out["test"], convert("e2e", paths["test"])[:30])
    return out


def _train_args(toy, out_dir, settings=SETTINGS, save_base=False):
    extra = ["--save-base"] if save_base else []
    return ["-m", "examples.nlg.train", *toy_train_args(toy, out_dir, STEPS, settings, *extra)]


def _launch(
    backend: str, nproc: int, args: list[str], env: dict | None = None, per_rank: str = ""
) -> subprocess.CompletedProcess:
    """``python ARGS --backend B`` in one process, or under the backend's launcher with ``nproc``;
    ``per_rank``: a setting appended by each rank's shell (``$RANK``: the rank). Run through
    ``sh`` so that a child killed by a signal does not upset jittor in this process."""
    prog = [sys.executable, *args[:2], "--backend", backend, *args[2:]]  # args[:2]: -m MODULE
    if per_rank:
        var = "RANK" if backend == "torch" else "OMPI_COMM_WORLD_RANK"
        prog = ["sh", "-c", f'exec "$@" {per_rank.replace("$RANK", "$" + var)}', "sh", *prog]
    if nproc == 1:
        cmd = prog
    elif backend == "torch":
        run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        cmd = [*run, *(["--no-python"] if per_rank else []), *(prog if per_rank else prog[1:])]
    else:
        mpirun = shutil.which("mpirun")
        assert mpirun, "mpirun not found: the jittor tests need Open MPI (apt-get install openmpi-bin libopenmpi-dev)"
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        opts = ["--oversubscribe", "--mca", "mpi_yield_when_idle", "1", "-x", "OMP_NUM_THREADS"]
        cmd = [mpirun, *root, *opts, "-np", str(nproc), *prog]
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    sh = ["sh", "-c", '"$@"; exit $?', "sh", *cmd]
    return subprocess.run(sh, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def _ok(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"


def _losses(run: Path) -> list[float]:
    return [x["loss"] for x in read_log(run / "log.jsonl") if x["kind"] == "train"]


def _adapter(run: Path, step: int = STEPS) -> dict:
    return read_tensors(run / f"ckpt-{step}" / "adapter.safetensors")


@pytest.fixture(scope="module")
def runs(backend, toy, tmp_path_factory):
    """Per backend: one process; 2 processes; 2 processes SIGKILLed (one rank) after update
    13 and resumed on 2 processes (a copy of the killed folder is kept for other resumes)."""
    name = backend.NAME
    d = tmp_path_factory.mktemp(f"dp-{name}")
    _ok(_launch(name, 1, _train_args(toy, d / "one", save_base=True)))
    t0 = time.perf_counter()
    _ok(_launch(name, 2, _train_args(toy, d / "two")))
    two_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    killed = _launch(name, 2, _train_args(toy, d / "cut") + ["--stop-after", str(KILL)])
    kill_s = time.perf_counter() - t0
    state = {
        "rc": killed.returncode,
        "stderr": killed.stderr,
        "latest": (d / "cut" / LATEST_FILE).read_text().strip(),
        "ckpts": sorted(p.name for p in (d / "cut").glob("ckpt-*")),
        "seconds": kill_s,
        "two_s": two_s,
    }
    shutil.copytree(d / "cut", d / "cut-copy")
    _ok(_launch(name, 2, _train_args(toy, d / "cut") + ["--resume"]))
    return {"dir": d, "one": d / "one", "two": d / "two", "cut": d / "cut", "copy": d / "cut-copy", "killed": state}


def test_two_processes_match_one(runs):
    a, b = _losses(runs["one"]), _losses(runs["two"])
    assert len(a) == len(b) == STEPS
    assert_close(f"dp 2 vs 1 process loss ({runs['dir'].name})", b, a, rtol=1e-5)
    ta, tb = _adapter(runs["one"]), _adapter(runs["two"])
    assert sorted(ta) == sorted(tb) and any(np.abs(ta[n]).max() > 0 for n in ta if "lora_B" in n)
    for n in ta:
        assert_close(f"dp 2 vs 1 process adapter ({runs['dir'].name})", tb[n], ta[n], rtol=1e-5)
    norms = [x["grad_norm"] for x in read_log(runs["two"] / "log.jsonl") if x["kind"] == "train"]
    assert any(g > 0.05 for g in norms)  # clipping acted on some updates
    log = read_log(runs["two"] / "log.jsonl")
    assert log[0]["world_size"] == 2 and len(log[-2]["peak_rss_mb_per_rank"]) == 2
    ev_a = [x["valid_nll"] for x in read_log(runs["one"] / "log.jsonl") if x["kind"] == "eval"]
    ev_b = [x["valid_nll"] for x in log if x["kind"] == "eval"]
    assert_close(f"dp 2 vs 1 process valid NLL ({runs['dir'].name})", ev_b, ev_a, rtol=1e-5)


def test_killed_rank_stops_the_job_and_resume_is_exact(runs):
    k = runs["killed"]
    assert k["rc"] != 0, k["stderr"][-2000:]
    assert k["latest"] == "ckpt-10" and k["ckpts"] == ["ckpt-10"], k
    assert k["seconds"] < k["two_s"] + 60, f"the killed job took {k['seconds']:.0f} s to stop"
    text = k["stderr"]  # the launcher names the killed rank (torchrun: "Signal 9 (SIGKILL)"; mpirun: "signal 9")
    assert "signal 9" in text.lower(), text[-3000:]
    ta, tb = _adapter(runs["two"]), _adapter(runs["cut"])
    assert all(np.array_equal(ta[n], tb[n]) for n in ta), "resumed 2-process adapter differs from the uninterrupted one"
    assert _losses(runs["two"]) == _losses(runs["cut"])


def test_sharded_beam_writes_the_one_process_file(runs, toy, backend):
    args = [
        "-m",
        "examples.nlg.beam",
        "--base",
        str(runs["one"] / "base"),
        "--adapter",
        str(runs["one"] / "ckpt-20"),
        "--test",
        str(toy["test"]),
        "--vocab",
        str(toy["tokenizer"]),
        "--recipe",
        "toy",
        "--batch-size",
        "3",
        "--set",
        "beam=2",
        "max_new_tokens=6",
    ]
    d = runs["dir"]
    _ok(_launch(backend.NAME, 1, [*args, "--out", str(d / "beam1.jsonl")]))
    _ok(_launch(backend.NAME, 2, [*args, "--out", str(d / "beam2.jsonl")]))
    one, two = (d / "beam1.jsonl").read_bytes(), (d / "beam2.jsonl").read_bytes()
    assert len(read_jsonl(d / "beam1.jsonl")) >= 5 and one == two


# ---------------------------------------------------------------- torch only: the engine-independent parts


def test_resume_on_another_number_of_processes(runs, toy, backend):
    if backend.NAME != "torch":
        pytest.skip("engine-independent: tested with torch")
    d = runs["dir"]
    shutil.copytree(runs["copy"], d / "cut1")
    _ok(_launch("torch", 1, _train_args(toy, d / "cut1") + ["--resume"]))
    ta, tb = _adapter(runs["one"]), _adapter(d / "cut1")
    for n in ta:
        assert_close("dp resume 2 -> 1 process adapter", tb[n], ta[n], rtol=1e-5)
    shutil.copytree(runs["copy"], d / "cut2")
    r = _launch("torch", 2, _train_args(toy, d / "cut2", [*SETTINGS, "batch_size=8"]) + ["--resume"])
    assert r.returncode != 0
    for rank in (0, 1):
        assert f"error: [rank {rank}/2]" in r.stderr and "batch_size is the global batch" in r.stderr, r.stderr[-3000:]
    assert sorted(p.name for p in (d / "cut2").glob("ckpt-*")) == ["ckpt-10"]


def test_ranks_with_different_settings_are_refused(toy, backend, tmp_path):
    """Each rank's shell adds its own lr: the configuration hash differs, every rank says so."""
    r = _launch(backend.NAME, 2, _train_args(toy, tmp_path / "b"), per_rank="lr=$(( $RANK + 1 ))e-3")
    assert r.returncode != 0
    for rank in (0, 1):
        want = f"error: [rank {rank}/2] the run configuration or code differs between ranks: rank(s) [1]"
        assert want in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "b").exists()


def test_ranks_on_different_base_weights_are_refused(toy, backend, tmp_path):
    """Each rank loads ``--init-checkpoint base`` from its own folder (as on two machines, each
    with its copy of the files): the same path, so the same run configuration, but other
    weights. Only the trained values are synchronised, so each rank would train against its own
    frozen base; the weights' fingerprint (``weights_fingerprint``) differs and every rank says so."""
    if backend.NAME != "torch":
        pytest.skip("engine-independent: tested with torch (jittor's weights_fingerprint: tests/test_rank_agreement.py)")
    import lora_core as lc

    cfg = lc.gpt2_config("tiny", vocab_size=toy["vocab_size"])
    for rank in (0, 1):
        lc.save_model(tmp_path / f"rank{rank}" / "base", cfg, lc.init_gpt2_weights(cfg, rank))
    args = toy_train_args(toy, tmp_path / "out", STEPS, SETTINGS)
    i = args.index("--random-init")
    args = args[:i] + ["--init-checkpoint", "base"] + args[i + 4:]  # without --vocab-size N
    prog = ["sh", "-c", f'cd {tmp_path}/rank$RANK && exec "$@"', "sh", sys.executable, "-m", "examples.nlg.train",
            "--backend", "torch", *args]  # fmt: skip
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--no-python"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    r = subprocess.run(["sh", "-c", '"$@"; exit $?', "sh", *run, *prog], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=TIMEOUT)  # fmt: skip
    assert r.returncode != 0
    for rank in (0, 1):
        want = (f"error: [rank {rank}/2] the model's weights as loaded (the base checkpoint: the same files on every "
                "rank) differs between ranks: rank(s) [1]")
        assert want in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def test_ranks_resuming_from_different_checkpoints_are_refused(runs, toy, backend, tmp_path):
    """Each rank reads OUT/latest itself: with another --out-dir on rank 1 (a node-local folder),
    rank 0 would resume at step 10 and rank 1 start over, and write a wrong checkpoint as
    latest. Refused on every rank before any update."""
    if backend.NAME != "torch":
        pytest.skip("engine-independent: tested with torch")
    shutil.copytree(runs["copy"], tmp_path / "o0")  # rank 0's OUT; rank 1's, o1, holds nothing
    r = _launch("torch", 2, _train_args(toy, tmp_path / "o0") + ["--resume"], per_rank=f"--out-dir {tmp_path}/o$RANK")
    assert r.returncode != 0
    for rank in (0, 1):
        want = f"error: [rank {rank}/2] resume: the ranks found different checkpoints in {tmp_path}/o{rank} "
        assert want + "(rank 0: step 10, rank 1: no checkpoint)" in r.stderr, r.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "o0").glob("ckpt-*")) == ["ckpt-10"]
    assert (tmp_path / "o0" / LATEST_FILE).read_text().strip() == "ckpt-10"


def test_bad_jobs_fail_on_every_rank(runs, toy, backend, tmp_path):
    if backend.NAME != "torch":
        pytest.skip("engine-independent: tested with torch")
    # a micro-batch of 1 example cannot be shared by 2 processes
    r = _launch("torch", 2, _train_args(toy, tmp_path / "a", [*SETTINGS, "batch_size=4", "grad_accum=4"]))
    assert r.returncode != 0 and not (tmp_path / "a").exists()
    for rank in (0, 1):
        assert f"error: [rank {rank}/2] 2 processes cannot share a batch of 4" in r.stderr, r.stderr[-3000:]
    # rank 0 of 2 alone: nobody to reach
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    t0 = time.perf_counter()
    r = _launch("torch", 1, _train_args(toy, tmp_path / "c") + ["--dist-timeout", "3"], env)
    assert r.returncode == 1 and time.perf_counter() - t0 < 60
    assert "error: rank 0 of 2 could not reach the others within 3 s" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "c").exists()
