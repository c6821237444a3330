"""How the suite itself runs: ``scripts/lora.sh test`` spreads test files over pytest-xdist
workers, and the parity figures the workers measure still reach the run's summary."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _workers(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``test_workers ARGS`` of ``scripts/lora.sh`` (the function alone, run by bash)."""
    script = (ROOT / "scripts" / "lora.sh").read_text()
    body = script[script.index("test_workers() {") : script.index("\n}\n", script.index("test_workers() {")) + 3]
    cmd = f'set -euo pipefail\nvenv={sys.prefix!r}\n{body}\nopts=$(test_workers "$@")\necho "[$opts]"'
    return subprocess.run(["bash", "-c", cmd, "bash", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)  # fmt: skip


def test_lora_sh_picks_workers_unless_the_arguments_do():
    cpus = min(4, len(os.sched_getaffinity(0)))
    default = f"[-n {cpus} --dist loadfile --no-loadscope-reorder]" if cpus > 1 else "[]"
    assert _workers("tests/test_nf4.py", "-q").stdout.strip() == default
    assert _workers(env={"LORA_TEST_WORKERS": "3"}).stdout.strip() == "[-n 3 --dist loadfile --no-loadscope-reorder]"
    assert _workers(env={"LORA_TEST_WORKERS": "1"}).stdout.strip() == "[]"
    for args in (["-n", "2"], ["-n2"], ["--numprocesses=2"], ["-p", "no:xdist"], ["--pdb"]):
        assert _workers(*args, env={"LORA_TEST_WORKERS": "3"}).stdout.strip() == "[]", args
    bad = _workers(env={"LORA_TEST_WORKERS": "two"})
    assert bad.returncode != 0 and "LORA_TEST_WORKERS=two: not a number of processes" in bad.stderr, bad


def test_parity_figures_come_back_from_the_workers():
    """Workers fill ``helpers.MEASURED`` in their own processes; the reports carry the ratios to
    the controlling process, which prints them (without the hooks the section is missing)."""
    cmd = [sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "-q", "tests/test_head_loss.py"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "LORA_TEST_BACKENDS": "torch"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "bringing up nodes" in proc.stdout, proc.stdout[:2000]  # run by xdist workers
    section = proc.stdout.split("parity: measured max|diff| / scale", 1)
    assert len(section) == 2, proc.stdout[-3000:]
    # the float32 ones (the bf16 ones, under autocast, are within bf16's rounding: ~1e-2)
    figures = [line for line in section[1].splitlines()
               if line.startswith("frozen-head LoRA grads vs plain") and "bf16" not in line]  # fmt: skip
    assert len(figures) >= 4 and all(0 <= float(line.split()[-1]) < 1e-5 for line in figures), section[1][:2000]
