"""The SST-2 demo (``examples.cls.demo``, ``scripts/lora.sh demo-cls``) end to end on the real
SST-2 files, shortened (a 20-step base, LoRA on 256 sentences): both backends train from the
same base, the report counts identical predictions over all 872 dev and 1,821 test sentences,
and the loss curves agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import MEASURED

ROOT = Path(__file__).resolve().parents[1]


def test_cls_demo_short_both_backends(shared_dir, tmp_path):
    out = tmp_path / "demo"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "examples.cls.demo", "--data-dir", str(shared_dir / "data"), "--out", str(out),
           "--train-examples", "256", "--pretrain-steps", "20"]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["backends"] == ["torch", "jittor"]
    assert rep["pretrain"]["steps"] == 20
    assert rep["identical_dev_predictions"] == "872/872"
    assert rep["identical_test_predictions"] == "1821/1821"
    assert rep["steps_compared"] >= 1
    assert rep["max_rel_loss_diff"] <= 1e-5, rep
    assert rep["max_adapter_diff"] <= 1e-4, rep
    MEASURED["cls demo (short): jittor vs torch loss"] = rep["max_rel_loss_diff"]
    MEASURED["cls demo (short): jittor vs torch adapter"] = rep["max_adapter_diff"]
    acc = rep["dev_accuracy"]
    assert acc["torch"] == acc["jittor"] and 0.0 <= acc["torch"] <= 1.0
    # the LoRA run saw 256 sentences: 8 updates of 32
    log = [json.loads(x) for x in (out / "torch" / "log.jsonl").read_text().splitlines()]
    assert max(x["step"] for x in log if x["kind"] == "train") == 8
    for f in ("report.md", "loss_curves.png", "base/config.json", "torch/test_predictions.tsv",
              "jittor/dev_predictions.tsv"):  # fmt: skip
        assert (out / f).is_file(), f
    assert len((out / "sst2-demo" / "train.jsonl").read_text().splitlines()) == 256
    assert "identical predictions: dev 872/872" in r.stdout
