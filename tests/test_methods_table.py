"""``python -m examples.lm.methods_table``'s merge of bench JSONs: it refuses files of different
workloads in one line, takes each row's %peak of its own file's GEMM peak (a footer lists the peaks
where they differ), names every row it leaves out as superseded, and writes its PNG atomically.
The files are small copies of a committed bench run (docs/bench/lm_zero_llama-bench_78c7bc5.json),
its settings and rows changed where a test says so."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.lm.methods_table import WORKLOAD, main, method_flops
from lora_core.plan.validate import SUPERSEDED

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "docs/bench/lm_zero_llama-bench_78c7bc5.json"  # llama-bench, 2 x 256, 1 thread, ZeRO over 2 ranks
KEEP = ("hf-peft full", "hf-peft", "hf-peft lora-z2", "ours-torch")  # a few rows: fast to plan


@pytest.fixture(scope="module")
def run() -> dict:
    d = json.loads(RUN.read_text())
    d["summary"]["medians"] = {k: v for k, v in d["summary"]["medians"].items() if k in KEEP}
    return d


def write(path: Path, d: dict, **settings) -> Path:
    d = copy.deepcopy(d)
    d["settings"].update(settings)
    path.write_text(json.dumps(d))
    return path


def table(out: str) -> dict:
    """The table's rows by (method, system): each row's columns as printed."""
    lines = out.splitlines()
    assert lines[0].startswith("method "), out
    return {(c[0], c[1]): c for c in (line.split() for line in lines[1:]) if len(c) >= 15}


def test_refuses_files_of_another_workload(tmp_path, run):
    """The review's repro: a copy of a run with shape, batch and threads changed (and a row's
    tokens/s) is refused, in one line naming both files and those keys, exit status 2, no table."""
    a = write(tmp_path / "a.json", run)
    other = copy.deepcopy(run)
    other["summary"]["medians"]["hf-peft"]["train_tok_s"] = 999.0
    b = write(tmp_path / "b.json", other, shape="gpt2", batch=8, threads=2)
    proc = subprocess.run([sys.executable, "-m", "examples.lm.methods_table", str(a), str(b)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    (line,) = proc.stderr.splitlines()
    assert str(a) in line and str(b) in line, line
    assert "shape ('gpt2' vs 'llama-bench')" in line and "batch (8 vs 2)" in line and "threads (2 vs 1)" in line, line
    assert "block" not in line and "layers" not in line and "vocab" not in line, line


@pytest.mark.parametrize("key", WORKLOAD)
def test_each_workload_setting_is_checked(tmp_path, run, capsys, key):
    a = write(tmp_path / "a.json", run)
    b = write(tmp_path / "b.json", run, **{key: {"shape": "gpt2", "threads": 2}.get(key, 12345)})
    assert main([str(a), str(b)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and f" {key} (" in err and "b.json" in err, err


def test_other_settings_merge_and_each_row_has_its_own_files_peak(tmp_path, run, capsys):
    """Files that differ in their code, systems, methods, ZeRO ranks, allocator and GEMM peak (another
    machine), or lack a workload key whose value is the default, merge; the re-run's row replaces the first file's, and each row's %peak is of its own
    file's peak (and ranks), which the footer lists."""
    a = write(tmp_path / "a.json", run)
    rerun = copy.deepcopy(run)
    rerun["summary"]["medians"] = {k: rerun["summary"]["medians"][k] for k in ("hf-peft", "hf-peft lora-z2")}
    rerun["summary"]["medians"]["hf-peft lora-z2"]["train_tok_s"] = 300.0
    rerun["gemm"]["peak_gflops"] = 160.0
    del rerun["settings"]["vocab"]  # a file before the --vocab option: None, the bench's default
    b = write(tmp_path / "b.json", rerun, code="0000000", systems=["hf-peft"], methods=["lora", "lora-z2"], ranks=4,
              steps=5, new_tokens=64, allocator="glibc", malloc_trim="auto", hf_zero_engine="deepspeed")  # fmt: skip
    assert main([str(a), str(b)]) == 0
    out, err = capsys.readouterr()
    rows = table(out)
    flops = run["flops_per_token"]
    z2 = rows[("lora-z2", "hf-peft")]
    assert z2[2] == "300.0"  # b's re-run replaced a's row
    assert z2[4] == f"{100 * method_flops(flops, 'lora-z2') * 300.0 / 1e9 / (4 * 160.0):.1f}", out  # 4 ranks of 160
    a_peak = run["gemm"]["peak_gflops"]
    tok = run["summary"]["medians"]["hf-peft full"]["train_tok_s"]
    assert rows[("full", "hf-peft")][4] == f"{100 * method_flops(flops, 'full') * tok / 1e9 / a_peak:.1f}", out
    assert out.splitlines()[-1] == (f"%peak: each row of its own file's fp32 GEMM peak, which differ: a.json "
                                    f"{a_peak:.1f}, b.json 160.0 GFLOP/s")  # fmt: skip
    # the same peak in both files: no footer
    c = write(tmp_path / "c.json", json.loads(a.read_text()), code="0000000")
    assert main([str(a), str(c)]) == 0
    assert "%peak:" not in capsys.readouterr().out


def test_superseded_rows_are_named_with_their_reason(tmp_path, run, capsys):
    """A committed run's file name marks rows ``SUPERSEDED``: each one left out is named on stderr,
    with the reason (ours-torch's LoRA row too, which ``SUPERSEDED`` keys by its system alone)."""
    name = RUN.name
    old = write(tmp_path / name, run)
    assert (name, "ours-torch") in SUPERSEDED and (name, "hf-peft") not in SUPERSEDED
    assert main([str(old)]) == 0
    out, err = capsys.readouterr()
    assert ("lora", "ours-torch") not in table(out) and ("lora", "hf-peft") in table(out)
    (line,) = [x for x in err.splitlines() if "ours-torch" in x]
    assert f"{name} ours-torch lora left out, superseded: {SUPERSEDED[(name, 'ours-torch')]}" in line, err
    assert "hf-peft" not in err, err


def test_unreadable_file_is_one_line(tmp_path, run, capsys):
    a = write(tmp_path / "a.json", run)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    for b in (bad, tmp_path / "missing.json"):
        assert main([str(a), str(b)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and str(b) in err, err


def test_plot_replaces_its_file_whole(tmp_path, run, capsys, monkeypatch):
    """The PNG is written beside its path and renamed over it: a draw that fails leaves the old file
    as it was and no temporary file; one that succeeds replaces it, keeping its mode."""
    import matplotlib.figure

    a = write(tmp_path / "a.json", run)
    png = tmp_path / "out" / "table.png"
    png.parent.mkdir()
    png.write_bytes(b"old")
    png.chmod(0o640)
    real = matplotlib.figure.Figure.savefig

    def broken(self, f, *args, **kw):
        (f.write(b"half a PNG") if hasattr(f, "write") else Path(f).write_bytes(b"half a PNG"))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", broken)
    assert main([str(a), "--plot", str(png)]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and str(png) in err and "No space left on device" in err, err
    assert png.read_bytes() == b"old" and os.listdir(png.parent) == ["table.png"]
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", real)
    assert main([str(a), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.listdir(png.parent) == ["table.png"]
    assert png.stat().st_mode & 0o777 == 0o640
