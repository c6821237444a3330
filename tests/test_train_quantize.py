"""``--quantize nf4`` (a QLoRA base) on the train commands (``examples.lm.train``,
``examples.nlg.train``; options in ``examples.run_options``): a tiny random Llama trained on a
4-bit base gives the same loss curve in both backends and resumes after a kill to the
uninterrupted log; GPT-2's per-slice LoRA on ``c_attn`` goes onto the 4-bit layer (the logits
of LoRA on the dequantized base) and the NLG command's quantized run differs from the plain
one; a resume with other 4-bit settings and quantize options that do not fit are refused in
one line before any work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_close, to_numpy, toy_train_args

import lora_core as lc
from examples.lm import train as lm_cli
from examples.nlg import train as nlg_cli
from lora_core.data.convert import convert
from lora_core.data.nlg import write_jsonl_atomic
from lora_core.data.tokenizer import encode_file, load_tokenizer
from lora_core.data.toy import make_toy_dataset
from lora_core.quant import nf4
from lora_core.quant.qlora import is_quantized_weight
from lora_core.train.run_dir import read_log

ROOT = Path(__file__).resolve().parents[1]
LM_SETTINGS = ["train.batch_size=4", "train.save_every=3", "train.eval_every=3", "train.log_every=1"]
NLG_SETTINGS = ["batch_size=4", "save_every=2", "eval_every=0", "log_every=1"]
_RUNS: dict = {}  # (kind, backend, options) -> run folder: each run once per session


def _run(module, *args, ok=True):
    """``python -m module args`` under ``sh`` (a child killed by a signal exits through it)."""
    cmd = ["sh", "-c", '"$@"; exit $?', "sh", sys.executable, "-m", module, *map(str, args)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if ok:
        assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The toy set as packed LM blocks (examples.lm.prepare) and as encoded NLG pairs."""
    root = tmp_path_factory.mktemp("quantize")
    toy = make_toy_dataset(root / "toy")
    lines = {s: [ln.split("||", 1)[1] for ln in toy[s].read_text().splitlines() if "||" in ln] for s in ("train", "valid")}
    (root / "a.txt").write_text("\n".join(lines["train"][:30]) + "\n")
    (root / "v.txt").write_text("\n".join(lines["valid"][:8]) + "\n")
    _run("examples.lm.prepare", "--tokenizer", toy["tokenizer"], "--train", root / "a.txt", "--valid", root / "v.txt",
         "--block-size", 32, "--out-dir", root / "lm")
    tok = load_tokenizer(toy["tokenizer"])
    nlg = {"vocab_size": tok.vocab_size}
    for split, n in (("train", 24), ("valid", 8)):
        nlg[split] = root / f"{split}.jsonl"
        write_jsonl_atomic(nlg[split], encode_file(tok, convert("e2e", toy[split])[:n]))
    vocab = json.loads((root / "lm" / "meta.json").read_text())["vocab_size"]
    return {"root": root, "lm": root / "lm", "vocab": vocab, "nlg": nlg}


def _lm_args(data, backend: str, out, *extra):
    return ["--backend", backend, "--recipe", "lm-demo", "--prepared", data["lm"], "--random-init", "tiny-llama",
            "--vocab-size", data["vocab"], "--out-dir", out, "--no-progress", "--max-steps", 6, "--quantize", "nf4",
            *extra, "--set", *LM_SETTINGS]  # fmt: skip


def _lm_run(data, backend: str) -> Path:
    key = ("lm", backend)
    if key not in _RUNS:
        out = data["root"] / f"lm-{backend}"
        _run("examples.lm.train", *_lm_args(data, backend, out))
        _RUNS[key] = out
    return _RUNS[key]


def _nlg_run(data, backend: str, *extra) -> Path:
    key = ("nlg", backend, extra)
    if key not in _RUNS:
        out = data["root"] / f"nlg-{backend}-{len(_RUNS)}"
        _run("examples.nlg.train", "--backend", backend, *toy_train_args(data["nlg"], out, 4, NLG_SETTINGS, *extra))
        _RUNS[key] = out
    return _RUNS[key]


def _records(out: Path, kind: str = "train") -> list[dict]:
    """The log's records of ``kind`` without their timings."""
    drop = {"ms_per_batch", "examples_per_s", "tokens_per_s", "peak_rss_mb", "peak_gpu_mb", "eval_s"}
    return [{k: v for k, v in r.items() if k not in drop} for r in read_log(out / "log.jsonl") if r["kind"] == kind]


def _losses(out: Path) -> np.ndarray:
    return np.array([r["loss"] for r in _records(out)])


def test_lm_qlora_curve_matches_torch_and_resumes_exactly(backend, data, capsys):
    """6 updates of LoRA on a 4-bit tiny Llama (quantized while loading OUT/base): the curve
    equals torch's within 1e-5; SIGKILL after update 4 (checkpoint at 3) + ``--resume``
    gives the uninterrupted log record for record; other 4-bit settings cannot resume it;
    ``examples.lm.evaluate --quantize nf4`` gives its last validation NLL."""
    full = _lm_run(data, backend.NAME)
    assert len(_losses(full)) == 6 and (full / "base" / "config.json").is_file()
    config = json.loads((full / "train_config.json").read_text())
    assert config["base"].endswith("quantize=nf4 double_quant=True compute_dtype=float32")
    assert_close(f"QLoRA lm-train loss curve, {backend.NAME} vs torch", _losses(full), _losses(_lm_run(data, "torch")),
                 1e-5)
    cut = data["root"] / f"lm-{backend.NAME}-cut"
    r = _run("examples.lm.train", *_lm_args(data, backend.NAME, cut, "--stop-after", 4), ok=False)
    assert r.returncode == 128 + 9, r.stderr[-3000:]
    _run("examples.lm.train", *_lm_args(data, backend.NAME, cut, "--resume"))
    assert _records(cut) == _records(full) and _records(cut, "eval") == _records(full, "eval")
    # a resume with other 4-bit settings (or none) is refused, naming them
    capsys.readouterr()
    assert lm_cli.main([str(a) for a in _lm_args(data, backend.NAME, cut, "--resume", "--no-double-quant")]) == 1
    err = capsys.readouterr().err
    assert "cannot resume" in err and "double_quant=True" in err and "double_quant=False" in err, err
    # examples.lm.evaluate with the same --quantize: the trainer's last validation NLL
    from examples.lm.evaluate import evaluate

    last = _records(full, "eval")[-1]["valid_nll"]
    quant = {"quantize": "nf4", "double_quant": True, "compute_dtype": "float32"}
    capsys.readouterr()
    res = evaluate(backend.NAME, full / "base", full, data["lm"], device="cpu", quant=quant)
    assert abs(res["nll"] - last) <= 1e-5 * last, (res, last)
    assert "warning" not in capsys.readouterr().err
    # ... and on the float32 base it was not trained on: evaluated, with a warning saying so
    other = evaluate(backend.NAME, full / "base", full, data["lm"], device="cpu")
    err = capsys.readouterr().err
    assert "was trained on a 4-bit base (quantize=nf4 double_quant=True compute_dtype=float32)" in err, err
    assert "loaded on a full-precision base" in err and other["nll"] != res["nll"]


def test_nlg_qlora_differs_from_lora_and_matches_torch(backend, data):
    """The NLG command with --quantize trains GPT-2's q, v slices of c_attn on a 4-bit base:
    other losses than the full-precision base's, the same in both backends."""
    q = _losses(_nlg_run(data, backend.NAME, "--quantize", "nf4"))
    plain = _losses(_nlg_run(data, "torch"))
    assert len(q) == len(plain) == 4 and np.abs(q - plain).max() > 1e-5 * np.abs(plain).max()
    assert_close(f"QLoRA nlg-train loss curve, {backend.NAME} vs torch", q,
                 _losses(_nlg_run(data, "torch", "--quantize", "nf4")), 1e-5)


def test_nlg_trains_on_a_bitsandbytes_4bit_checkpoint_without_quantize(data, tmp_path):
    """A bitsandbytes 4-bit checkpoint loads 4-bit without --quantize (as examples.lm.train loads
    it): the NLG command injects its LoRA on it (it refused before, naming from_pretrained's
    lora= argument), and trains the curve of the float32 base quantized by --quantize nf4."""
    q_run = _nlg_run(data, "torch", "--quantize", "nf4")  # OUT/base: the float32 random init it quantized
    bk = lc.get_backend("torch")
    bk.save_quantized(bk.from_pretrained(q_run / "base", quantize="nf4"), tmp_path / "four")
    args = toy_train_args(data["nlg"], tmp_path / "out", 4, NLG_SETTINGS)
    i = args.index("--random-init")
    args = args[:i] + ["--init-checkpoint", str(tmp_path / "four")] + args[i + 4:]  # without --vocab-size N
    assert "--vocab-size" not in args
    _run("examples.nlg.train", "--backend", "torch", *args)
    assert_close("NLG QLoRA curve: a 4-bit checkpoint vs --quantize nf4 on its float32 base",
                 _losses(tmp_path / "out"), _losses(q_run), 1e-6)
    assert "quantize=nf4 double_quant=True" in (tmp_path / "out" / "train_config.json").read_text()


def test_gpt2_per_slice_lora_on_4bit_base(backend, tmp_path):
    """GPT-2's LoRAConfig (q and v slices of the fused c_attn) injected on a 4-bit base gives
    the logits of the same LoRA on the dequantized float32 base."""
    cfg = lc.gpt2_config("tiny", vocab_size=128)
    lora = lc.LoRAConfig(r=4, alpha=8.0, seed=3)
    base = lc.init_gpt2_weights(cfg, 1)
    lc.save_model(tmp_path / "base", cfg, base)
    q = backend.from_pretrained(tmp_path / "base", quantize="nf4")
    backend.inject_lora(q, lora)
    rng = np.random.default_rng(0)
    values = {n: rng.normal(0, 0.05, tuple(p.shape)).astype(np.float32)
              for n, p in backend.trainable_parameters(q).items()}
    assert sorted(values) == ["h.0.attn.c_attn.lora_A", "h.0.attn.c_attn.lora_B", "h.1.attn.c_attn.lora_A",
                              "h.1.attn.c_attn.lora_B"] and values["h.0.attn.c_attn.lora_B"].shape == (128, 4)
    q.load_partial(values)
    deq = {k: nf4.dequantize_nf4(nf4.quantize_nf4(v)) if is_quantized_weight(k) else v for k, v in base.items()}
    ref = backend.build_model(cfg, lora, base=deq)
    ref.load_partial(values)
    ids = rng.integers(0, 128, (2, 9))
    out = [to_numpy(m(ids)[0]) for m in (q, ref)]
    assert_close(f"4-bit GPT-2 per-slice LoRA logits vs LoRA on the dequantized base ({backend.NAME})", *out, 1e-5)


def _refused(main, argv: list, capsys, expected: str, tmp_path: Path) -> None:
    """One ``error:`` line, status 1, nothing written under ``tmp_path``."""
    before = sorted(tmp_path.rglob("*"))
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 1
    err = capsys.readouterr().err
    assert err == f"error: {expected}\n", err
    assert sorted(tmp_path.rglob("*")) == before


def test_quantize_options_that_do_not_fit_are_refused(data, tmp_path, capsys):
    full = "--quantize nf4 with method full: a 4-bit base is frozen, QLoRA trains a LoRA adapter on it (use " \
           "--method lora, or leave out --quantize)"
    lm = ["--recipe", "lm-demo", "--prepared", data["lm"], "--random-init", "tiny-llama", "--vocab-size", data["vocab"],
          "--out-dir", tmp_path / "o"]
    nlg = toy_train_args(data["nlg"], tmp_path / "o", 2, NLG_SETTINGS)
    for main, args in ((lm_cli.main, lm), (nlg_cli.main, nlg)):
        _refused(main, [*args, "--quantize", "nf4", "--method", "full"], capsys, full, tmp_path)
        _refused(main, [*args, "--no-double-quant"], capsys,
                 "--no-double-quant applies to a 4-bit base only: add --quantize nf4", tmp_path)
        _refused(main, [*args, "--compute-dtype", "bfloat16", "--no-double-quant"], capsys,
                 "--no-double-quant and --compute-dtype apply to a 4-bit base only: add --quantize nf4", tmp_path)
    # a recipe whose method is full (the paper's FT row)
    ft = [a if a != "toy" else "e2e-medium-ft" for a in nlg]
    _refused(nlg_cli.main, [*ft[: ft.index("--set")], "--quantize", "nf4"], capsys, full, tmp_path)
