"""The one-process speed A/B (``examples.lm.speed_ab``): its summary arithmetic, and a tiny run
of ours-torch against transformers + peft (same first loss, a ratio per round, the JSON)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from examples.lm.speed_ab import bootstrap_median, main, summarise

ROOT = Path(__file__).resolve().parents[1]


def test_summary_takes_the_ratio_per_round():
    times = {"a": [1.0, 2.0, 1.0, 4.0], "b": [1.5, 2.0, 3.0, 4.4]}  # per round: 1.5, 1.0, 3.0, 1.1
    s = summarise(times, tokens=100)
    assert s["systems"]["a"]["median_step_s"] == 1.5 and s["systems"]["a"]["tok_s"] == pytest.approx(100 / 1.5)
    r = s["ratios"]["a / b"]
    assert r["per_round"] == pytest.approx([1.5, 1.0, 3.0, 1.1])
    assert r["median"] == pytest.approx(1.3)  # not the ratio of the medians (2.2 / 1.5)
    lo, hi = r["interval"]
    assert 1.0 <= lo <= r["median"] <= hi <= 3.0
    assert bootstrap_median([2.0] * 5) == (2.0, 2.0)


@pytest.mark.parametrize("precision, rel", [("fp32", 1e-5), ("bf16", 1e-3)])
def test_tiny_run_of_ours_and_transformers(tmp_path, precision, rel):
    """In its own process, as a user runs it (it sets the process's thread count); in float32 and
    under bf16 autocast (every system's forward, as the GPU bench runs them)."""
    out = tmp_path / "ab.json"
    cmd = [sys.executable, "-m", "examples.lm.speed_ab", "--shape", "tiny-llama", "--block", "16", "--rounds", "2",
           "--precision", precision, "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "tokens/s ours-torch / hf-peft: median of per-round ratios" in proc.stdout, proc.stdout
    assert f"16 tokens, {precision}," in proc.stdout, proc.stdout
    res = json.loads(out.read_text())
    assert res["settings"]["precision"] == precision
    assert res["loss0"]["ours-torch"] == pytest.approx(res["loss0"]["hf-peft"], rel=rel)  # same weights, same tokens
    assert [len(v) for v in res["times"].values()] == [2, 2]
    assert len(res["summary"]["ratios"]["ours-torch / hf-peft"]["per_round"]) == 2


@pytest.mark.parametrize("argv, message", [
    (["--method", "lora-z2"], "ZeRO rows need several processes"),
    (["--systems", "ours-torch"], "two or three different systems"),
    (["--systems", "ours-torch,ours-torch"], "two or three different systems"),
    (["--rounds", "0"], "--rounds must be at least 1"),
])  # fmt: skip
def test_bad_options_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err
