"""The benchmark script runs end to end on the tiny and demo shapes (a smoke test, not a timed test)."""

import json

import numpy as np
import pytest
from helpers import MEASURED

from examples.nlg import bench


def test_bench_tiny_all_systems(shared_dir, tmp_path, capsys):
    """Every system on the tiny and demo shapes; ours-torch decodes with the captured step."""
    data = shared_dir / "data"
    if not (data / "e2e" / "train.txt").is_file():
        pytest.skip(f"shared E2E data missing: {data} (set LORA_SHARED)")
    out = tmp_path / "bench.json"
    rc = bench.main(["--data-dir", str(data), "--shapes", "tiny,demo", "--steps", "2", "--warmup", "1", "--repeats", "1",
                     "--beam-examples", "2", "--threads", "1", "--decode-step", "captured", "--json", str(out)])  # fmt: skip
    table = capsys.readouterr().out
    assert rc == 0, table
    rows = {line.split()[0] for line in table.splitlines() if line.strip()}
    assert set(bench.SYSTEMS) <= rows, table
    for label, *_ in bench.TARGETS:
        assert label in table, (label, table)
    result = json.loads(out.read_text())
    for shape in ("tiny", "demo"):
        for system in bench.SYSTEMS:
            (run,) = result["raw"][shape][system]
            assert run["train_tok_s"] > 0 and run["train_rss_mb"] > 0 and run["beam_s_ex"] > 0, run
            assert len(run["step_s"]) == 3 and len(run["gen_lengths"]) == 2, run
            assert run["gen_lengths"] == [64, 64], run  # eos banned before 64 new tokens (--beam-min-new default)
        assert len(result["summary"][shape]["targets"]) == len(bench.TARGETS)


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
