"""The benchmark script runs end to end on the tiny and demo shapes (a smoke test, not a timed test)."""

import json

import numpy as np
import pytest
from helpers import MEASURED

from examples.nlg import bench


def test_bench_tiny_all_systems(shared_dir, tmp_path, capsys):
    """Every system on the tiny shape, ours-torch on the demo shape too (its toy data set and
    BPE made as the demo makes them; the systems' code is the tiny shape's); ours-torch decodes
    with the captured step."""
    data = shared_dir / "data"
    if not (data / "e2e" / "train.txt").is_file():
        pytest.skip(f"shared E2E data missing: {data} (set LORA_SHARED)")
    out = tmp_path / "bench.json"
    rc = bench.main(["--data-dir", str(data), "--shapes", "tiny", "--steps", "2", "--warmup", "1", "--repeats", "1",
                     "--beam-examples", "2", "--threads", "1", "--decode-step", "captured", "--json", str(out)])  # fmt: skip
    table = capsys.readouterr().out
    assert rc == 0, table
    rows = {line.split()[0] for line in table.splitlines() if line.strip()}
    assert set(bench.SYSTEMS) <= rows, table
    for label, *_ in bench.TARGETS:
        assert label in table, (label, table)
    result = json.loads(out.read_text())
    assert set(result["raw"]) == {"tiny"}
    for system in bench.SYSTEMS:
        (run,) = result["raw"]["tiny"][system]
        assert run["train_tok_s"] > 0 and run["train_rss_mb"] > 0 and run["beam_s_ex"] > 0, run
        assert len(run["step_s"]) == 3 and len(run["gen_lengths"]) == 2, run
        assert run["gen_lengths"] == [64, 64], run  # eos banned before 64 new tokens (--beam-min-new default)
        assert len(run["beams_sha256"]) == 64, run
    assert len(result["summary"]["tiny"]["targets"]) == len(bench.TARGETS)
    rc = bench.main(["--data-dir", str(data), "--shapes", "demo", "--systems", "ours-torch", "--steps", "1", "--warmup", "1",
                     "--repeats", "1", "--beam-examples", "1", "--threads", "1", "--json", str(out)])  # fmt: skip
    table = capsys.readouterr().out
    assert rc == 0, table
    (run,) = json.loads(out.read_text())["raw"]["demo"]["ours-torch"]
    assert run["train_tok_s"] > 0 and len(run["step_s"]) == 2 and len(run["gen_lengths"]) == 1, run


def test_bench_batch_and_compiled_step(shared_dir, tmp_path, capsys):
    """``--batch`` sets the training batch and ``--compile`` runs ours-torch's step through
    ``torch.compile`` (compiled over the timed batches before timing); an unknown backend is
    refused, naming the choices."""
    data = shared_dir / "data"
    if not (data / "e2e" / "train.txt").is_file():
        pytest.skip(f"shared E2E data missing: {data} (set LORA_SHARED)")
    out = tmp_path / "bench.json"
    rc = bench.main(["--data-dir", str(data), "--shapes", "tiny", "--systems", "ours-torch", "--steps", "2",
                     "--warmup", "1", "--repeats", "1", "--beam-examples", "1", "--batch", "4",
                     "--compile", "eager", "--json", str(out)])  # fmt: skip
    table = capsys.readouterr().out
    assert rc == 0, table
    assert "batch 4," in table and "ours-torch compile eager" in table, table
    (run,) = json.loads(out.read_text())["raw"]["tiny"]["ours-torch"]
    assert run["compiled_graphs"] >= 1 and run["compile_s"] > 0, run
    assert len(run["step_s"]) == len(run["seq_len"]) == 3, run
    assert abs(run["train_ex_s"] - 4 * 2 / sum(run["step_s"][1:])) < 1e-9 * run["train_ex_s"], run  # 4 per batch
    with pytest.raises(SystemExit):
        bench.main(["--data-dir", str(data), "--compile", "turbo"])
    assert "unknown dynamo backend 'turbo'" in capsys.readouterr().err


def test_bench_row_of_a_failed_system_says_why(shared_dir, tmp_path, capsys):
    """A system that refuses its settings (jittor and bf16) gets a row whose errors column
    carries the worker's exception, and the bench exits 1."""
    data = shared_dir / "data"
    if not (data / "e2e" / "train.txt").is_file():
        pytest.skip(f"shared E2E data missing: {data} (set LORA_SHARED)")
    rc = bench.main(["--data-dir", str(data), "--shapes", "tiny", "--systems", "ours-jittor", "--steps", "1",
                     "--warmup", "0", "--repeats", "1", "--beam-examples", "1", "--precision", "bf16"])  # fmt: skip
    table = capsys.readouterr().out
    (row,) = [line for line in table.splitlines() if line.startswith("ours-jittor")]
    assert rc == 1 and "worker exited with 1: ValueError: precision='bf16' is not supported by the jittor backend" in row, table


def test_cls_bench_lists_failed_runs():
    from examples.cls import bench as cls_bench

    run = {"train_ex_s": 10.0, "eval_ex_s": 50.0, "rss_mb": 300.0, "dev_accuracy": 0.5}
    table = cls_bench.summarise({"ours-torch": [run], "hf-peft": [{"error": "worker killed by SIGABRT"}]})
    assert "| ours-torch | 10.00 |" in table and "| hf-peft |" not in table, table
    assert table.endswith("errors (these runs are left out of the tables):\n- hf-peft run 1: worker killed by SIGABRT")


def test_bench_gpu_table_and_targets():
    """On a GPU the table adds peak GPU memory and the GPU's name, and checks issue 8's targets:
    training >= 2x HF+PEFT at batch 8 (1.5x above) on gpt2-medium, beam <= 0.5x, GPU memory <= 1x."""
    import argparse

    def run(ex_s, tok_s, gpu_mb, beam_s):
        return {"train_ex_s": ex_s, "train_tok_s": tok_s, "train_rss_mb": 900.0, "train_phase_rss_mb": 800.0,
                "beam_s_ex": beam_s, "gen_len": 64.0, "beam_rss_mb": 950.0, "train_gpu_mb": gpu_mb,
                "beam_gpu_mb": gpu_mb / 2, "loadavg_start": 0.5, "gpu_name": "NVIDIA H200", "torch": "2.11.0",
                "torch_cuda": "13.0"}  # fmt: skip

    raw = {"gpt2-medium": {"ours-torch": [run(300.0, 15000.0, 2000.0, 0.06)],
                           "hf-peft": [run(175.0, 8000.0, 3800.0, 0.146)]}}  # fmt: skip
    for batch, bound, result in ((8, 2.0, "FAIL"), (32, 1.5, "PASS")):
        args = argparse.Namespace(device="cuda", batch=batch, steps=10, warmup=2, repeats=1, threads=1,
                                  beam_examples=16, precision="fp32", compile="inductor", driver="580.1",
                                  beam_batch={"ours-torch": 8, "hf-peft": 8})  # fmt: skip
        table, summary = bench.summarise(raw, args)
        assert "train GPU MB" in table and "GPU NVIDIA H200, driver 580.1, torch 2.11.0 (CUDA 13.0)" in table, table
        got = {t["target"].split()[0] + " " + t["target"].split()[1]: t for t in summary["gpt2-medium"]["targets"]}
        assert got["train tok/s"]["bound"] == bound and got["train tok/s"]["result"] == result, got
        assert abs(got["train tok/s"]["ratio"] - 15000 / 8000) < 1e-12
        assert got["peak GPU"]["result"] == "PASS" and abs(got["peak GPU"]["ratio"] - 2000 / 3800) < 1e-12
        assert got["beam s/ex"]["result"] == "PASS"
    args.device = "cpu"
    table, summary = bench.summarise(raw, args)
    assert "GPU MB" not in table and all("GPU" not in t["target"] for t in summary["gpt2-medium"]["targets"])


def test_bench_medians_over_repeats_skip_missing_figures():
    """Medians over repeats; a figure a run lacks or reports as None (GPU memory on a CPU, a
    failed run) is left out, and None when no run has it."""
    runs = [{"train_ex_s": 3.0, "train_gpu_mb": None}, {"train_ex_s": 1.0, "train_gpu_mb": None},
            {"train_ex_s": 2.0, "beam_s_ex": 0.5}]  # fmt: skip
    med = bench.medians(runs)
    assert med["train_ex_s"] == 2.0 and med["beam_s_ex"] == 0.5
    assert med["train_gpu_mb"] is None and med["beam_gpu_mb"] is None


@pytest.mark.gpu
def test_bench_runs_on_the_gpu(shared_dir, tmp_path, capsys):
    """``--device cuda``: every system trains and decodes on the GPU, with its peak GPU memory;
    ours-torch's captured decode step (CUDA graphs) decodes the beams its eager step decodes,
    on the same GPU and inputs (a capture that records the wrong work fails here)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    data = shared_dir / "data"
    raw = {}
    for step, systems in (("captured", "ours-torch,hf-peft,hf-peft-bf16"), ("eager", "ours-torch")):
        out = tmp_path / f"bench-{step}.json"
        rc = bench.main(["--data-dir", str(data), "--shapes", "tiny", "--systems", systems, "--steps", "2",
                         "--warmup", "1", "--repeats", "1", "--beam-examples", "4", "--device", "cuda",
                         "--decode-step", step, "--json", str(out)])  # fmt: skip
        table = capsys.readouterr().out
        assert rc == 0 and "train GPU MB" in table, table
        raw[step] = json.loads(out.read_text())["raw"]["tiny"]
    for system, (run,) in raw["captured"].items():
        assert run["train_gpu_mb"] > 0 and run["beam_gpu_mb"] > 0 and run["gpu_name"], (system, run)
    (captured,), (eager,) = raw["captured"]["ours-torch"], raw["eager"]["ours-torch"]
    assert captured["beams_sha256"] == eager["beams_sha256"] and captured["gen_lengths"] == eager["gen_lengths"]


def _sst2_and_tiny_base(shared_dir, tmp_path, seed: int):
    """The shared data folder (skip without SST-2) and a tiny head-less HF DistilBERT masked-LM
    folder in ``tmp_path/base`` drawn with ``seed``."""
    import torch
    import transformers

    data = shared_dir / "data"
    if not (data / "sst2" / "dev.tsv").is_file():
        pytest.skip(f"shared SST-2 data missing: {data}")
    cfg = transformers.DistilBertConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64)
    torch.manual_seed(seed)
    transformers.DistilBertForMaskedLM(cfg).save_pretrained(tmp_path / "base")
    return data


def test_cls_bench_tiny_from_a_base(shared_dir, tmp_path, capsys):
    """The DistilBERT/SST-2 benchmark starts every system from one HF base folder (a head-less
    masked-LM checkpoint: same seeded head everywhere) and reports dev accuracy over all 872
    dev sentences."""
    from examples.cls import bench as cls_bench

    data = _sst2_and_tiny_base(shared_dir, tmp_path, seed=0)
    out = tmp_path / "cls.json"
    rc = cls_bench.main(["--data-dir", str(data), "--base", str(tmp_path / "base"), "--steps", "1", "--warmup", "0",
                         "--json", str(out)])  # fmt: skip
    table = capsys.readouterr().out
    assert rc == 0, table
    raw = json.loads(out.read_text())["raw"]
    for system in cls_bench.SYSTEMS:
        (run,) = raw[system]
        assert run["train_ex_s"] > 0 and run["eval_ex_s"] > 0 and 0 <= run["dev_accuracy"] <= 1, run
        assert system in table
    # no update yet changes the head's answer much: one update from the same weights and batch
    first = {s: raw[s][0]["loss"][0] for s in cls_bench.SYSTEMS}
    assert max(first.values()) - min(first.values()) < 0.05, first


def test_cls_bench_systems_train_the_same_without_dropout(shared_dir, tmp_path, capsys):
    """Same base, same LoRA init (ours copied into peft's layers), dropout off: the three
    systems' losses agree over 4 updates and their dev predictions give the same accuracy; off
    the distilbert shape the targets are information only."""
    from examples.cls import bench as cls_bench

    data = _sst2_and_tiny_base(shared_dir, tmp_path, seed=1)
    out = tmp_path / "cls.json"
    rc = cls_bench.main(["--data-dir", str(data), "--base", str(tmp_path / "base"), "--steps", "3", "--warmup", "1",
                         "--no-dropout", "--json", str(out)])  # fmt: skip
    table = capsys.readouterr().out
    assert rc == 0, table
    assert "info (the targets are for the distilbert shape)" in table and "| yes |" not in table
    raw = json.loads(out.read_text())["raw"]
    ref = np.array(raw["ours-torch"][0]["loss"])
    assert len(ref) == 4
    for system in ("ours-jittor", "hf-peft"):
        rel = np.abs(np.array(raw[system][0]["loss"]) - ref) / np.abs(ref)
        assert rel.max() < 1e-4, (system, rel)
        MEASURED[f"cls bench, no dropout: {system} vs ours-torch loss (4 updates)"] = float(rel.max())
    assert len({raw[s][0]["dev_accuracy"] for s in cls_bench.SYSTEMS}) == 1, raw


def test_cls_bench_keeps_a_systems_good_runs_and_says_n_a():
    """One failed run of three leaves the system's other two in the medians (it dropped the
    system); a target whose system has no good run says n/a, not nothing."""
    from examples.cls import bench as cls_bench

    def run(ex_s):
        return {"train_ex_s": ex_s, "eval_ex_s": 50.0, "rss_mb": 300.0, "dev_accuracy": 0.5}

    table = cls_bench.summarise({"ours-torch": [run(14.0), run(14.2), {"error": "worker killed by SIGKILL"}],
                                 "hf-peft": [run(10.0)] * 3, "ours-jittor": [{"error": "boom"}]})
    assert "| ours-torch | 14.10 |" in table, table
    assert "| train ex/s   ours-torch / hf-peft | >= 1.3 | 1.41 |" in table, table
    assert "| train ex/s   ours-jittor / ours-torch | >= 0.9 | n/a | n/a (no run of ours-jittor without an error) |" in table
    assert "- ours-torch run 3: worker killed by SIGKILL" in table


def test_bench_options_refused_before_any_run(tmp_path, capsys):
    """Each bench refuses at parse time what it would only find out after its runs: an output
    that cannot be written, an unknown dynamo backend, sizes and names that cannot run."""
    from examples.bench_worker import check_outputs
    from examples.cls import bench as cls_bench
    from examples.lm import bench as lm_bench
    from examples.lm import gpu_bench, speed_ab

    assert check_outputs(json=tmp_path / "a.json", plot=None) is None
    assert check_outputs(json=tmp_path) == f"--json {tmp_path}: is a folder (give a file name)"
    missing = tmp_path / "no" / "x.png"
    assert check_outputs(plot=missing) == f"--plot {missing}: the folder {tmp_path / 'no'} does not exist"
    for main, argv, words in (
        (lm_bench.main, ["--shape", "tiny-llama", "--plot", str(missing)], "the folder"),
        (lm_bench.main, ["--shape", "tiny-llama", "--compile", "bogus"], "--compile: unknown dynamo backend 'bogus'"),
        (lm_bench.main, ["--shape", "tiny-llama", "--systems", "hf-peft", "--compile", "eager"], "add ours-torch to"),
        (gpu_bench.main, ["--decode", "-1"], "--decode must be >= 0"),
        (gpu_bench.main, ["--methods", "lora,lora"], "--methods: ['lora'] named twice"),
        (gpu_bench.main, ["--systems", "ours-torch", "--decode", "4"], "give both in --systems"),
        (cls_bench.main, ["--systems", ","], "--systems: unknown []"),
        (cls_bench.main, ["--repeats", "0"], "--steps, --repeats and --threads must be >= 1"),
        (bench.main, ["--beam-batch", "0"], "--beam-batch: '0' is not a batch size"),
        (speed_ab.main, ["--systems", "ours-torch,ours-jittor", "--precision", "bf16"], "trains in fp32 only"),
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err, (argv, err)


def test_cls_bench_refuses_a_training_split_shorter_than_its_steps(shared_dir, tmp_path):
    """The steps would otherwise get short or empty batches (a loss over nothing)."""
    from examples.cls import bench as cls_bench

    (tmp_path / "sst2").mkdir()
    (tmp_path / "sst2" / "train.tsv").write_text("sentence\tlabel\na fine film\t1\na dull one\t0\n")
    (tmp_path / "distilbert-vocab").symlink_to(shared_dir / "data" / "distilbert-vocab")
    with pytest.raises(ValueError, match=r"train.tsv: 2 sentences; the bench's steps take 64 "):
        cls_bench.batches(tmp_path, 64, 16)
    assert [len(b["labels"]) for b in cls_bench.batches(tmp_path, 2, 1)] == [1, 1]
