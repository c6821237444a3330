"""Training loop: exact resume after a real kill, checkpoint atomicity, JSONL log, schedule,
data order, recipe overrides, the train and plot CLIs (tiny model, toy data, a dozen steps)."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import toy_train_args

import lora_core
from examples.nlg import plot as plot_cli
from examples.nlg import train as train_cli
from lora_core.data.batching import collate
from lora_core.data.convert import convert
from lora_core.data.nlg import write_jsonl_atomic
from lora_core.data.tokenizer import encode_file, load_tokenizer
from lora_core.data.toy import make_toy_dataset
from lora_core.formats.checkpoint import read_tensors
from lora_core.train.recipes import RECIPES, TrainConfig, apply_overrides, get_recipe
from lora_core.train.schedule import lr_at
from lora_core.train.trainer import (
    LATEST_FILE,
    epoch_batches,
    find_checkpoint,
    read_log,
    steps_per_epoch,
    total_steps,
    train,
)

ROOT = Path(__file__).resolve().parents[1]
# 48 examples in batches of 4: 12 updates per epoch; checkpoints every 6; dropout on.
SETTINGS = ["batch_size=4", "warmup=3", "save_every=6", "eval_every=4", "log_every=1", "lora_dropout=0.1"]
STEPS = 12


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The toy data set, encoded: 48 training and 16 validation examples."""
    d = tmp_path_factory.mktemp("toy")
    paths = make_toy_dataset(d)
    tok = load_tokenizer(paths["tokenizer"])
    out = {"vocab_size": tok.vocab_size}
    for split, n in (("train", 48), ("valid", 16)):
        out[split] = d / f"{split}48.jsonl"
        write_jsonl_atomic(out[split], encode_file(tok, convert("e2e", paths[split])[:n]))
    return out


def _cli_args(backend_name, toy, out_dir):
    return ["--backend", backend_name, *toy_train_args(toy, out_dir, STEPS, SETTINGS)]


def _run_cli(args, via_shell: bool = False) -> subprocess.CompletedProcess:
    """Run the train CLI. ``via_shell``: through ``sh``, so that this process's child exits
    normally even when the CLI is SIGKILLed (jittor, once imported here, quick-exits this
    process on SIGCHLD from a child killed by a signal); sh reports 128 + 9."""
    cmd = [sys.executable, "-m", "examples.nlg.train", *args]
    if via_shell:
        cmd = ["sh", "-c", '"$@"; exit $?', "sh", *cmd]
    # one thread: same numerics in every run, and no OpenMP spinning on a busy 2-core CI box
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(backend, toy, tmp_path_factory):
    """Per backend, three processes of the train CLI: an uninterrupted run, and a run
    SIGKILLed after update 8 (checkpoint at 6) then resumed."""
    base = tmp_path_factory.mktemp(f"runs-{backend.NAME}")
    full, cut = base / "full", base / "cut"
    r = _run_cli(_cli_args(backend.NAME, toy, full))
    assert r.returncode == 0, r.stderr
    r = _run_cli(_cli_args(backend.NAME, toy, cut) + ["--stop-after", "8"], via_shell=True)
    assert r.returncode == 128 + signal.SIGKILL, (r.returncode, r.stderr)
    killed = {
        "latest": (cut / LATEST_FILE).read_text().strip(),
        "ckpts": sorted(p.name for p in cut.glob("ckpt-*")),
        "steps": [x["step"] for x in read_log(cut / "log.jsonl") if x["kind"] == "train"],
    }
    r = _run_cli(_cli_args(backend.NAME, toy, cut) + ["--resume"])
    assert r.returncode == 0, r.stderr
    return {"full": full, "cut": cut, "killed": killed}


# --------------------------------------------------------------------------- (a) exact resume


def test_resume_after_kill_is_exact(runs):
    k = runs["killed"]
    assert k["latest"] == "ckpt-6" and k["ckpts"] == ["ckpt-6"]
    assert k["steps"] == list(range(1, 9))  # it ran past its checkpoint before the kill
    full, cut = runs["full"] / f"ckpt-{STEPS}", runs["cut"] / f"ckpt-{STEPS}"
    a, b = read_tensors(full / "adapter.safetensors"), read_tensors(cut / "adapter.safetensors")
    assert sorted(a) == sorted(b) and any("lora_A" in n for n in a)
    diff = [n for n in a if not np.array_equal(a[n], b[n])]
    assert not diff, f"resumed adapter differs from the uninterrupted one in {diff}"
    assert any(np.abs(a[n]).max() > 0 for n in a if "lora_B" in n)  # B starts at zero: it trained
    oa, ob = read_tensors(full / "trainer_state.safetensors"), read_tensors(cut / "trainer_state.safetensors")
    assert sorted(oa) == sorted(ob) and all(np.array_equal(oa[n], ob[n]) for n in oa)
    assert oa["t"].item() == STEPS
    la = [x["loss"] for x in read_log(runs["full"] / "log.jsonl") if x["kind"] == "train"]
    lb = [x["loss"] for x in read_log(runs["cut"] / "log.jsonl") if x["kind"] == "train"]
    assert la == lb and len(la) == STEPS  # lines past the checkpoint were replaced, not duplicated


# --------------------------------------------------------------------------- (b) log


def test_log_lines(runs):
    recs = read_log(runs["cut"] / "log.jsonl")
    for line in (runs["cut"] / "log.jsonl").read_text().splitlines():
        json.loads(line)  # strict JSON: no NaN
    train_recs = [x for x in recs if x["kind"] == "train"]
    fields = {
        "step",
        "epoch",
        "lr",
        "loss",
        "avg_loss",
        "ms_per_batch",
        "examples_per_s",
        "tokens_per_s",
        "peak_rss_mb",
    }
    for x in train_recs:
        assert fields <= set(x), fields - set(x)
        assert x["tokens_per_s"] > 0 and x["peak_rss_mb"] > 10 and np.isfinite(x["loss"])
        assert x["avg_loss"] == pytest.approx(x["loss"])  # log_every=1: a window of one update
    evals = [x for x in recs if x["kind"] == "eval"]
    assert [x["step"] for x in evals] == [4, 8, 12]
    for x in evals:
        assert x["valid_ppl"] == pytest.approx(np.exp(x["valid_nll"])) and x["valid_tokens"] > 0
    starts = [x for x in recs if x["kind"] == "start"]
    assert [(x["step"], x["resumed"]) for x in starts] == [(0, False), (6, True)]
    cfg = json.loads((runs["cut"] / "train_config.json").read_text())
    assert cfg["train"]["lora_dropout"] == 0.1 and cfg["data"]["n_train"] == 48


# --------------------------------------------------------------------------- (c) schedule, data order


def test_schedule_values(runs):
    assert lr_at(0, 2e-4, 500, 26290) == 0.0
    assert lr_at(250, 2e-4, 500, 26290) == pytest.approx(1e-4)
    assert lr_at(500, 2e-4, 500, 26290) == pytest.approx(2e-4)
    assert lr_at(13395, 2e-4, 500, 26290) == pytest.approx(1e-4)
    assert lr_at(26290, 2e-4, 500, 26290) == 0.0
    assert lr_at(600, 2e-4, 500, 26290, "constant") == 2e-4
    cfg = apply_overrides(get_recipe("toy").train, SETTINGS)
    logged = [(x["step"], x["lr"]) for x in read_log(runs["full"] / "log.jsonl") if x["kind"] == "train"]
    assert logged == [(s, lr_at(s - 1, cfg.lr, cfg.warmup, STEPS, "linear")) for s in range(1, STEPS + 1)]
    # the paper's E2E run: 42,061 examples, batch 8, 5 epochs -> 5 x 5,258 updates
    assert total_steps(get_recipe("e2e-medium").train, 42061) == 26290


def test_epoch_batches():
    a = epoch_batches(10, 4, seed=3, epoch=0)
    assert [len(b) for b in a] == [4, 4, 2] and sorted(np.concatenate(a).tolist()) == list(range(10))
    assert all(np.array_equal(x, y) for x, y in zip(a, epoch_batches(10, 4, seed=3, epoch=0), strict=True))
    assert not np.array_equal(np.concatenate(a), np.concatenate(epoch_batches(10, 4, seed=3, epoch=1)))
    fill = epoch_batches(10, 4, 3, 0, "fill")
    assert [len(b) for b in fill] == [4, 4, 4] and np.array_equal(np.concatenate(fill)[:10], np.concatenate(a))
    assert [len(b) for b in epoch_batches(10, 4, 3, 0, "drop")] == [4, 4]
    assert (steps_per_epoch(10, 4), steps_per_epoch(10, 4, "fill"), steps_per_epoch(10, 4, "drop")) == (3, 3, 2)


def test_dropout_masks_follow_the_seed(backend):
    cfg = lora_core.gpt2_config("tiny-32")
    lora = lora_core.LoRAConfig(r=4, alpha=32, dropout=0.5)
    lw = lora_core.init_lora_weights(cfg, lora)
    lw = {k: (v if "lora_A" in k else np.full_like(v, 0.1)) for k, v in lw.items()}  # B != 0: dropout shows
    model = backend.build_model(cfg, lora, base=lora_core.init_gpt2_weights(cfg, 0), lora_weights=lw)
    opt = backend.AdamW(backend.trainable_parameters(model))
    batch = collate([([5, 6, 7, 8], [9, 10, 11]), ([12, 13], [14, 15, 16, 17])])
    losses = []
    for seed in (1, 1, 2):
        backend.manual_seed(seed)
        losses.append(backend.train_step(model, opt, [batch], lr=0.0)["loss"])
    assert losses[0] == losses[1] and losses[0] != losses[2]


def test_parity_mode_gives_both_backends_the_same_masks(toy, tmp_path):
    names = {n.strip() for n in os.environ.get("LORA_TEST_BACKENDS", "torch,jittor").split(",")}
    if not {"torch", "jittor"} <= names:
        pytest.skip("compares torch with jittor: LORA_TEST_BACKENDS names only " + ",".join(sorted(names)))
    from lora_core.data.nlg import read_encoded

    cfg = apply_overrides(get_recipe("toy").train, SETTINGS + ["dropout_masks=numpy", "eval_every=0", "save_every=0"])
    tr = read_encoded(toy["train"])
    mcfg = lora_core.gpt2_config("tiny", vocab_size=toy["vocab_size"])
    base = lora_core.init_gpt2_weights(mcfg, 0)
    losses, adapters = {}, {}
    for name in ("torch", "jittor"):
        be = lora_core.get_backend(name)
        model = be.build_model(mcfg, cfg.lora_config(), base=base)
        train(be, model, tr, None, cfg, tmp_path / name, max_steps=STEPS, progress=False)
        losses[name] = np.array([x["loss"] for x in read_log(tmp_path / name / "log.jsonl") if x["kind"] == "train"])
        adapters[name] = be.lora_state_dict(model)
    np.testing.assert_allclose(losses["jittor"], losses["torch"], rtol=1e-5)
    for n, a in adapters["torch"].items():
        np.testing.assert_allclose(adapters["jittor"][n], a, rtol=1e-3, atol=1e-6, err_msg=n)


# --------------------------------------------------------------------------- (d) overrides


def test_recipes_and_overrides():
    e2e, dart = get_recipe("e2e-large").train, get_recipe("dart-medium").train
    assert (e2e.batch_size, e2e.epochs, e2e.lr, e2e.warmup, e2e.lora_r, e2e.lora_alpha) == (8, 5, 2e-4, 500, 4, 32)
    assert (e2e.weight_decay, e2e.lora_dropout, e2e.label_smooth, e2e.max_grad_norm) == (0.01, 0.1, 0.1, 0.0)
    assert (dart.weight_decay, dart.lora_dropout, dart.label_smooth) == (0.0, 0.0, 0.0)
    assert [RECIPES[f"{d}-medium"].beam.length_penalty for d in ("e2e", "webnlg", "dart")] == [0.9, 0.8, 0.8]
    assert e2e.lora_config().enable_lora == (True, False, True)
    cfg = apply_overrides(
        TrainConfig(),
        ["lr=1e-3", "pad_to=512", "max_steps=none", "adam_betas=0.9, 0.98", "correct_bias=false", "schedule=constant"],
    )
    assert (cfg.lr, cfg.pad_to, cfg.max_steps, cfg.adam_betas, cfg.correct_bias) == (
        1e-3,
        512,
        None,
        (0.9, 0.98),
        False,
    )
    assert apply_overrides(get_recipe("toy"), ["beam.length_penalty=0.7"]).beam.length_penalty == 0.7
    # a choice of ints (ZeRO's stage) is parsed to the int, as --zero gives it
    assert apply_overrides(TrainConfig(), ["zero=2"]).zero == 2 and apply_overrides(TrainConfig(), ["zero=0"]).zero == 0
    bad = {
        "zero=1": "choose one of [0, 2, 3]",
        "lora_r=0": "an int >= 1 with method 'lora'",
        "lrr=1": "unknown setting 'lrr'",
        "lr=fast": "expected a number",
        "batch_size=2.5": "expected an int",
        "schedule=cosine": "choose one of",
        "lr": "expected key=value",
        "batch_size=0": "positive int",
        "lr=inf": "a finite number > 0",  # it trained to a NaN loss
        "lr=-1": "a finite number > 0",
        "label_smooth=1.5": "in [0, 1)",
        "correct_bias=maybe": "true or false",
        "adam_betas=0.9": "2 comma",
    }
    for item, msg in bad.items():
        with pytest.raises(ValueError, match=re.escape(msg)):
            apply_overrides(TrainConfig(), [item])
    with pytest.raises(ValueError, match="nested config"):
        apply_overrides(get_recipe("toy"), ["beam=3"])
    with pytest.raises(ValueError, match=re.escape("unknown setting 'save_every' for Recipe (did you mean train.save_every?)")):
        apply_overrides(get_recipe("toy"), ["save_every=3"])
    with pytest.raises(ValueError, match="unknown recipe"):
        get_recipe("e2e-small")


def test_cli_rejects_bad_override(toy, tmp_path, capsys):
    args = _cli_args("torch", toy, tmp_path / "x")
    assert train_cli.main(args[: -len(SETTINGS)] + ["warmpu=3"]) == 1
    assert "unknown setting 'warmpu'" in capsys.readouterr().err
    # the "train." prefix of the other train commands' --set is taken too (a key of TrainConfig after it)
    assert train_cli.main(args[: -len(SETTINGS)] + ["train.warmpu=3"]) == 1
    assert "unknown setting 'warmpu' for TrainConfig" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_cli_init_checkpoint(backend, toy, tmp_path):
    """``--save-base`` writes the random base; ``--init-checkpoint`` on it trains the same adapter."""
    args = _cli_args(backend.NAME, toy, tmp_path / "a")
    args[args.index("--max-steps") + 1] = "3"
    assert train_cli.main(args + ["--save-base"]) == 0
    init = args.index("--random-init")
    other = args[:init] + ["--init-checkpoint", str(tmp_path / "a" / "base")] + args[init + 4 :]
    other[other.index("--out-dir") + 1] = str(tmp_path / "b")
    assert train_cli.main(other) == 0
    a, b = (read_tensors(tmp_path / d / "ckpt-3" / "adapter.safetensors") for d in "ab")
    assert all(np.array_equal(a[n], b[n]) for n in a)
    meta = json.loads((tmp_path / "b" / "ckpt-3" / "adapter_config.json").read_text())
    assert meta["base"] == str(tmp_path / "a" / "base")


# --------------------------------------------------------------------------- (e) torn checkpoints


def test_half_written_checkpoint_is_ignored(backend, toy, tmp_path):
    from lora_core.data.nlg import read_encoded

    cfg = apply_overrides(get_recipe("toy").train, SETTINGS + ["save_every=3", "eval_every=0"])
    tr, va = read_encoded(toy["train"]), read_encoded(toy["valid"])
    mcfg = lora_core.gpt2_config("tiny", vocab_size=toy["vocab_size"])
    base = lora_core.init_gpt2_weights(mcfg, 0)

    def fit(out, resume=False):
        model = backend.build_model(mcfg, cfg.lora_config(), base=base)
        return train(backend, model, tr, va, cfg, out, resume=resume, max_steps=9, progress=False)

    out = tmp_path / "run"
    fit(out)
    want = read_tensors(out / "ckpt-9" / "adapter.safetensors")
    # what a kill during the save of step 9 leaves: a temp folder with a torn file, a temp
    # pointer, and `latest` still on the previous checkpoint
    import shutil

    shutil.rmtree(out / "ckpt-9")
    (out / LATEST_FILE).write_text("ckpt-6\n")
    torn = out / ".ckpt-9.x1y2.tmp"
    torn.mkdir()
    (torn / "adapter.safetensors").write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a":')
    (out / ".latest.abc.tmp").write_text("ckpt-9\n")
    assert find_checkpoint(out).name == "ckpt-6"
    with pytest.raises(FileExistsError, match="resume"):
        fit(out)  # a fresh start never overwrites a run
    summary = fit(out, resume=True)
    assert summary["step"] == 9 and not torn.exists()
    got = read_tensors(out / "ckpt-9" / "adapter.safetensors")
    assert all(np.array_equal(want[n], got[n]) for n in want)
    # without `latest`, the highest complete checkpoint; a pointer to nothing is an error
    os.remove(out / LATEST_FILE)
    assert find_checkpoint(out).name == "ckpt-9"
    (out / LATEST_FILE).write_text("ckpt-99\n")
    with pytest.raises(FileNotFoundError, match="ckpt-99"):
        find_checkpoint(out)
    (out / LATEST_FILE).write_text("ckpt-9\n")
    cfg = apply_overrides(cfg, ["lr=1e-2"])
    with pytest.raises(ValueError, match="differs from the saved one"):
        fit(out, resume=True)


def test_resume_between_log_records_keeps_the_average(toy, tmp_path):
    """``avg_loss`` averages the updates since the previous record; a run resumed from a checkpoint
    between two records (save_every 3, log_every 4) logs the uninterrupted run's averages, bit for
    bit (the window is part of the trainer state); a checkpoint written before that field resumes."""
    from lora_core.data.nlg import read_encoded

    be = lora_core.get_backend("torch")
    cfg = apply_overrides(get_recipe("toy").train, SETTINGS + ["save_every=3", "eval_every=0", "log_every=4"])
    mcfg = lora_core.gpt2_config("tiny", vocab_size=toy["vocab_size"])
    tr = read_encoded(toy["train"])

    def fit(out, **kw):
        model = be.build_model(mcfg, cfg.lora_config(), base=lora_core.init_gpt2_weights(mcfg, 0))
        return train(be, model, tr, None, cfg, out, max_steps=9, progress=False, **kw)

    def records(out):
        return [r for r in read_log(out / "log.jsonl") if r["kind"] == "train"]

    fit(tmp_path / "run")
    first = records(tmp_path / "run")
    assert [r["step"] for r in first] == [4, 8, 9]
    fit(tmp_path / "run", resume_from=tmp_path / "run" / "ckpt-3")  # the log cut back to step 3, then continued
    again = records(tmp_path / "run")
    assert [(r["step"], r["loss"], r["avg_loss"]) for r in again] == [(r["step"], r["loss"], r["avg_loss"]) for r in first]
    state = json.loads((tmp_path / "run" / "ckpt-3" / "trainer_state.json").read_text())
    assert state["window_steps"] == 3 and state["window_loss"] > 0
    for k in ("window_loss", "window_steps"):  # as an older version wrote it
        del state[k]
    (tmp_path / "run" / "ckpt-3" / "trainer_state.json").write_text(json.dumps(state))
    assert fit(tmp_path / "run", resume_from=tmp_path / "run" / "ckpt-3")["step"] == 9
    assert records(tmp_path / "run")[0]["avg_loss"] == first[0]["loss"]  # a window of step 4 alone


def test_run_files_get_the_umasks_mode(toy, tmp_path):
    """Files written atomically (temp file + rename) and checkpoint folders get the mode a plain
    ``open``/``mkdir`` would under the umask, not ``mkstemp``'s 0600 / ``mkdtemp``'s 0700."""
    import stat

    from lora_core.data.nlg import read_encoded

    be = lora_core.get_backend("torch")
    cfg = apply_overrides(get_recipe("toy").train, SETTINGS + ["eval_every=0", "save_every=2"])
    mcfg = lora_core.gpt2_config("tiny", vocab_size=toy["vocab_size"])
    for mask, file_mode, dir_mode in ((0o022, 0o644, 0o755), (0o077, 0o600, 0o700)):
        old = os.umask(mask)
        try:
            model = be.build_model(mcfg, cfg.lora_config(), base=lora_core.init_gpt2_weights(mcfg, 0))
            out = tmp_path / f"run-{mask:o}"
            train(be, model, read_encoded(toy["train"]), None, cfg, out, max_steps=2, progress=False)
        finally:
            os.umask(old)
        ckpt = out / "ckpt-2"
        assert stat.S_IMODE(ckpt.stat().st_mode) == dir_mode, oct(ckpt.stat().st_mode)
        for f in (out / "train_config.json", out / LATEST_FILE, *ckpt.iterdir()):
            assert stat.S_IMODE(f.stat().st_mode) == file_mode, (f, oct(f.stat().st_mode))


def test_zero_on_one_process_says_it_shards_nothing(toy, tmp_path, capsys):
    from lora_core.data.nlg import read_encoded

    be = lora_core.get_backend("torch")
    cfg = apply_overrides(get_recipe("toy").train, SETTINGS + ["eval_every=0", "zero=2"])
    mcfg = lora_core.gpt2_config("tiny", vocab_size=toy["vocab_size"])
    model = be.build_model(mcfg, cfg.lora_config(), base=lora_core.init_gpt2_weights(mcfg, 0))
    train(be, model, read_encoded(toy["train"]), None, cfg, tmp_path / "run", max_steps=1, progress=False)
    assert "note: ZeRO stage 2 on one process shards nothing" in capsys.readouterr().err
    # --resume where nothing was saved yet: a fresh start, said so
    model = be.build_model(mcfg, cfg.lora_config(), base=lora_core.init_gpt2_weights(mcfg, 0))
    train(be, model, read_encoded(toy["train"]), None, cfg, tmp_path / "fresh", max_steps=1, progress=False, resume=True)
    assert f"note: resume: {tmp_path / 'fresh'} holds no checkpoint yet; starting at step 0" in capsys.readouterr().err


def test_pad_to_shorter_than_an_example_is_refused_before_training(toy, tmp_path):
    from lora_core.data.nlg import read_encoded

    be = lora_core.get_backend("torch")
    data = read_encoded(toy["train"])
    longest = max(len(r["context"]) + len(r["completion"]) - 1 for r in data)
    cfg = apply_overrides(get_recipe("toy").train, SETTINGS + ["eval_every=0", f"pad_to={longest - 1}"])
    mcfg = lora_core.gpt2_config("tiny", vocab_size=toy["vocab_size"])
    model = be.build_model(mcfg, cfg.lora_config(), base=lora_core.init_gpt2_weights(mcfg, 0))
    with pytest.raises(ValueError, match=f"pad_to={longest - 1}: the data holds an example of {longest} input tokens"):
        train(be, model, data, None, cfg, tmp_path / "run", max_steps=1, progress=False)
    assert not (tmp_path / "run" / "ckpt-1").exists()


# --------------------------------------------------------------------------- plot


def test_plot_cli(runs, tmp_path):
    out = tmp_path / "curves.png"
    logs = [str(runs["full"] / "log.jsonl"), str(runs["cut"] / "log.jsonl")]
    assert plot_cli.main([*logs, "--labels", "full", "resumed", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_run_folder_of_an_older_version_resumes(toy, tmp_path):
    """A train_config.json written before the task and precision keys existed (an LM run in
    fp32) resumes; a real difference is still refused."""

    from lora_core.data.nlg import read_encoded

    be = lora_core.get_backend("torch")
    cfg = apply_overrides(get_recipe("toy").train, SETTINGS + ["save_every=2", "eval_every=0"])
    mcfg = lora_core.gpt2_config("tiny", vocab_size=toy["vocab_size"])
    tr = read_encoded(toy["train"])

    def fit(c):
        model = be.build_model(mcfg, c.lora_config(), base=lora_core.init_gpt2_weights(mcfg, 0))
        return train(be, model, tr, None, c, tmp_path / "run", max_steps=4, resume=True, progress=False)

    fit(cfg)
    path = tmp_path / "run" / "train_config.json"
    saved = json.loads(path.read_text())
    del saved["task"], saved["train"]["precision"], saved["train"]["loss_scale"], saved["valid_data"]
    path.write_text(json.dumps(saved))
    assert fit(cfg)["step"] == 4
    with pytest.raises(ValueError, match="train.precision: saved 'fp32', now 'bf16'"):
        fit(dataclasses.replace(cfg, precision="bf16"))


def test_resume_over_another_validation_set_is_refused(toy, tmp_path):
    """The validation set is part of the run (its losses are one curve in log.jsonl): a resume
    with another one is refused naming it, as one with other training data is."""
    from lora_core.data.nlg import read_encoded

    be = lora_core.get_backend("torch")
    cfg = apply_overrides(get_recipe("toy").train, SETTINGS + ["save_every=2", "eval_every=2"])
    mcfg = lora_core.gpt2_config("tiny", vocab_size=toy["vocab_size"])
    tr, va = read_encoded(toy["train"]), read_encoded(toy["valid"])

    def fit(valid, steps):
        model = be.build_model(mcfg, cfg.lora_config(), base=lora_core.init_gpt2_weights(mcfg, 0))
        return train(be, model, tr, valid, cfg, tmp_path / "run", max_steps=steps, resume=True, progress=False)

    fit(va, 4)
    with pytest.raises(ValueError, match=rf"cannot resume, the run differs from the saved one:\n  valid_data.n_valid: "
                                         rf"saved {len(va)}, now {len(va) - 1}\n  valid_data.sha256"):  # fmt: skip
        fit(va[:-1], 4)
    assert fit(va, 4)["step"] == 4


def test_last_checkpoint_follows_the_final_evaluation(toy, tmp_path, monkeypatch):
    """With save_every dividing the run and no evaluation due at its end by eval_every, the final
    evaluation still comes before the last checkpoint: a run killed between the two resumes from an
    earlier checkpoint and evaluates again (the last checkpoint was written first: a resume found
    the run done and never evaluated it)."""
    from lora_core.data.nlg import read_encoded
    from lora_core.train.trainer import Trainer

    events = []
    for name, kind in (("_evaluate", "eval"), ("save_checkpoint", "save")):
        orig = getattr(Trainer, name)
        monkeypatch.setattr(Trainer, name, lambda self, *a, _o=orig, _k=kind: events.append((_k, self.state.step))
                            or _o(self, *a))  # fmt: skip
    be = lora_core.get_backend("torch")
    cfg = apply_overrides(get_recipe("toy").train, SETTINGS + ["save_every=3", "eval_every=0"])
    mcfg = lora_core.gpt2_config("tiny", vocab_size=toy["vocab_size"])
    model = be.build_model(mcfg, cfg.lora_config(), base=lora_core.init_gpt2_weights(mcfg, 0))
    out = train(be, model, read_encoded(toy["train"]), read_encoded(toy["valid"]), cfg, tmp_path / "run",
                max_steps=9, progress=False)  # fmt: skip
    assert events == [("save", 3), ("save", 6), ("eval", 9), ("save", 9)] and "valid_nll" in out


def test_non_finite_values_are_logged_as_json_null(toy, tmp_path):
    """A diverged run's loss is NaN: log.jsonl says null (JSON has no NaN; strict readers refuse it)."""
    from lora_core.data.nlg import read_encoded

    be = lora_core.get_backend("torch")
    cfg = apply_overrides(get_recipe("toy").train, SETTINGS + ["lr=1e30", "warmup=0", "eval_every=2"])
    mcfg = lora_core.gpt2_config("tiny", vocab_size=toy["vocab_size"])
    model = be.build_model(mcfg, cfg.lora_config(), base=lora_core.init_gpt2_weights(mcfg, 0))
    train(be, model, read_encoded(toy["train"]), read_encoded(toy["valid"]), cfg, tmp_path / "run", max_steps=4,
          progress=False)  # fmt: skip

    def refuse(name):
        raise AssertionError(f"{name} in log.jsonl")

    recs = [json.loads(line, parse_constant=refuse) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert any(r["kind"] == "train" and r["loss"] is None for r in recs)
    assert any(r["kind"] == "eval" and r["valid_nll"] is None for r in recs)


def test_drop_with_a_batch_larger_than_the_training_set_is_refused(toy, tmp_path):
    """last_batch 'drop' and fewer examples than batch_size: no batch in an epoch (the loop spun
    forever with max_steps, or divided by zero without): refused before the run folder."""
    from lora_core.data.nlg import read_encoded

    be = lora_core.get_backend("torch")
    cfg = apply_overrides(get_recipe("toy").train, SETTINGS + ["batch_size=64", "last_batch=drop"])
    mcfg = lora_core.gpt2_config("tiny", vocab_size=toy["vocab_size"])
    model = be.build_model(mcfg, cfg.lora_config(), base=lora_core.init_gpt2_weights(mcfg, 0))
    for steps in (5, None):
        with pytest.raises(ValueError, match=r"batch_size=64 with last_batch='drop' leaves no batch: .* 48 examples"):
            train(be, model, read_encoded(toy["train"]), None, cfg, tmp_path / "run", max_steps=steps, progress=False)
    assert not (tmp_path / "run").exists()
