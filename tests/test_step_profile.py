"""The step profile (``examples.lm.step_profile``): its split of profiler events, the bound's
arithmetic, and a tiny run of ours-torch against transformers + peft (the same products counted
in both, the parts adding up to the profiled step)."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from examples.lm.step_profile import bound, main, part_of, split_events, summarise

ROOT = Path(__file__).resolve().parents[1]


def test_operators_are_split_into_gemm_attention_and_the_rest():
    assert part_of("aten::mm") == part_of("aten::addmm") == part_of("aten::bmm") == "gemm"
    assert part_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert part_of("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert part_of("aten::mul") == part_of("aten::matmul") == part_of("aten::linear") == "other"  # wrappers: no self GEMM time
    ev = [SimpleNamespace(key="aten::mm", self_cpu_time_total=3e6, flops=6e9, count=4),
          SimpleNamespace(key="aten::addmm", self_cpu_time_total=1e6, flops=2e9, count=1),
          SimpleNamespace(key="aten::_scaled_dot_product_flash_attention_for_cpu", self_cpu_time_total=0.5e6, flops=0, count=2),
          SimpleNamespace(key="aten::silu", self_cpu_time_total=0.25e6, flops=None, count=2)]  # fmt: skip
    s = split_events(ev)
    assert s["gemm"] == 4.0 and s["attention"] == 0.5 and s["other"] == 0.25 and s["total"] == 4.75
    assert s["gemm_flops"] == 8e9 and s["gemm_calls"] == 5


def test_the_bound_takes_the_other_systems_step_over_the_target():
    prof = {"ours": [{"gemm": 1.6, "attention": 0.2, "other": 0.2, "total": 2.0, "gemm_flops": 1.6e11, "gemm_calls": 3}],
            "hf": [{"gemm": 1.6, "attention": 0.2, "other": 0.4, "total": 2.2, "gemm_flops": 1.6e11, "gemm_calls": 3}]}
    s = summarise({"ours": [2.0], "hf": [2.2]}, prof, tokens=100)
    assert s["ours"]["gemm_s"] == pytest.approx(1.6) and s["hf"]["other_s"] == pytest.approx(0.4)
    assert s["ours"]["gemm_gflops_per_s"] == pytest.approx(100.0)
    b = bound(s, 1.1 / 1.05, flops_step=1.8e11, peak_gflops=100.0, fraction=0.8)
    assert b["step_needed_s"] == pytest.approx(2.1) and b["rest_allowed_s"] == pytest.approx(0.5)
    assert b["rest_s"] == pytest.approx(0.4) and b["reachable_same_gemms"]
    assert b["peak_step_s"] == pytest.approx(2.25) and b["reachable_at_peak_fraction"]
    b = bound(s, 1.2, flops_step=1.8e11, peak_gflops=100.0, fraction=1.0)
    assert not b["reachable_same_gemms"] and b["peak_step_s"] == pytest.approx(1.8) and not b["reachable_at_peak_fraction"]


def test_tiny_run_counts_the_same_products_in_both_systems(tmp_path):
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "examples.lm.step_profile", "--shape", "tiny-llama", "--block", "16", "--rounds", "2",
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "ours-torch at 1.1x hf-peft's tokens/s: a step of at most" in proc.stdout, proc.stdout
    res = json.loads(out.read_text())
    ours, hf = res["profiled"]["ours-torch"], res["profiled"]["hf-peft"]
    assert len(ours) == len(hf) == 2 and len(res["plain"]["ours-torch"]) == 2
    for step in ours + hf:
        assert step["total"] == pytest.approx(step["gemm"] + step["attention"] + step["other"])
        assert step["gemm"] > 0 and step["attention"] > 0
    # LoRA on q, k, v, o: the same products in both (their FLOPs from the recorded shapes), below
    # the bench's count of the step (which adds attention's and the LM head's last position)
    assert ours[0]["gemm_flops"] == hf[0]["gemm_flops"] > 0.85 * res["flops_step"]
    assert ours[0]["gemm_flops"] < res["flops_step"]
    assert res["summary"]["ours-torch"]["fractions"]["gemm"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--method", "lora-z2"], "--method 'lora-z2'"),
    (["--systems", "ours-torch"], "two different systems"),
    (["--systems", "ours-torch,ours-jittor"], "two different systems"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--peak-fraction", "1.5"], "--peak-fraction in (0, 1]"),
])  # fmt: skip
def test_bad_options_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err
