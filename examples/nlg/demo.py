"""The embedded demo: both backends, train -> beam -> decode -> evaluate, with a parity report.

    bash scripts/lora.sh demo                       # toy data made here, no download
    bash scripts/lora.sh demo --data-dir ../shared/data   # real E2E (needs e2e/; a 1,024-token BPE trained on it)

Steps (output folder ``--out``, default ``runs/demo``):
1. Data: the toy restaurant set (``lora_core.data.toy``: E2E format, its own byte-level BPE) or
   E2E from ``--data-dir`` with a 1,024-token byte-level BPE trained on its training texts
   (GPT-2's 50,257-token head would make the self-made base too slow to pre-train on a
   CPU); formatted JSONL files are written to ``OUT/data``.
2. A small GPT-2 base, made here (no pretrained weights can be downloaded): a tiny GPT-2
   pre-trained with full fine-tuning on the first half of the training MRs in another
   layout, ``bpe(MR + " => " + text) + [eos]``. It stands in for GPT-2's pre-training; it
   has never seen the paper's layout ``bpe(MR) + [eos] + bpe(" " + text) + [eos]``.
3. LoRA (q, v; r=4, alpha=32, dropout 0.1 with the shared numpy masks of parity mode) on the
   second half, in torch and in jittor, from the same base and LoRA init and data order.
4. Beam search (beam 10, length penalty 0.9, no-repeat 4-grams) on the test MRs, decoding to
   the E2E evaluator's files, scoring with ``eval`` (BLEU, NIST, METEOR, ROUGE-L, CIDEr).
5. ``OUT/parity.md`` / ``parity.json``: per-step loss difference, share of identical beam
   outputs, metric differences; ``OUT/loss_curves.png``; ``OUT/samples.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

import lora_core as lc
from lora_core.data.batching import collate
from lora_core.data.convert import convert_e2e
from lora_core.data.nlg import group_references, write_jsonl_atomic, write_text_atomic
from lora_core.data.tokenizer import encode_file, load_tokenizer
from lora_core.data.toy import make_toy_dataset, train_toy_tokenizer
from lora_core.generate.decode import check_e2e_groups, make_eval_files
from lora_core.train.recipes import get_recipe
from lora_core.train.trainer import read_log, train

from ..run_options import doc_summary
from .beam import decode_contexts, write_beam_jsonl


def pin_threads(n: int) -> None:
    """Run torch and jittor with ``n`` threads, whatever the machine's core count.

    A float32 sum split over a different number of threads rounds differently; 800 training
    updates amplify that, so the demo's scores depend on the thread count (measured on the
    README's machine: BLEU 0.9278 with 2 threads, 0.9050 with 1). Both frameworks read
    ``OMP_NUM_THREADS`` when they are first imported, which the demo does only after this
    (called from Python after importing them: torch is set directly, jittor keeps its count)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)
    if "jittor" in sys.modules:
        print(f"note: jittor was imported before the demo set {n} thread(s); it keeps its own count", file=sys.stderr)


def prepare_data(out: Path, data_dir: Path | None):
    """Tokenizer and formatted records: toy set made here, or E2E from ``data_dir``."""
    if data_dir is None:
        paths, name = make_toy_dataset(out / "data"), "toy"
        tok = load_tokenizer(out / "data")
    else:  # a small BPE trained on E2E: a CPU cannot pre-train a 50,257-token base in minutes
        paths, name = {s: data_dir / "e2e" / f"{s}.txt" for s in ("train", "valid", "test")}, "E2E"
    recs = {s: convert_e2e(paths[s]) for s in ("train", "valid", "test")}
    if data_dir is not None:
        (out / "data").mkdir(parents=True, exist_ok=True)
        texts = [t for r in recs["train"] for t in (r["context"], " " + r["completion"])]
        train_toy_tokenizer(texts, 1024).save(str(out / "data" / "tokenizer.json"))
        tok = load_tokenizer(out / "data" / "tokenizer.json")
    for s, r in recs.items():
        write_jsonl_atomic(out / "data" / f"{s}_formatted.jsonl", r)
    return tok, recs, name


def pretrain_base(tok, records: list[dict], steps: int, preset: str, seed: int = 0, progress: bool = True) -> tuple:
    """Full fine-tuning of a random tiny GPT-2 as a plain LM on ``MR => text`` documents (torch)."""
    bt = lc.get_backend("torch")
    cfg = lc.gpt2_config(preset, vocab_size=tok.vocab_size)
    model = bt.build_model(cfg, None, lc.init_gpt2_weights(cfg, seed))
    opt = bt.AdamW(bt.trainable_parameters(model), lc.optim.AdamWConfig(weight_decay=0.01))
    docs = [tok.encode(r["context"] + " => " + r["completion"]) + [tok.eos_id] for r in records]
    docs = [(d[:1], d[1:]) for d in docs]
    rng = np.random.default_rng(seed)
    from tqdm import tqdm
    bar = tqdm(range(steps), desc="pre-train base (torch)", unit="step", disable=not progress)
    for s in bar:
        idx = rng.choice(len(docs), 16, replace=False)
        out = bt.train_step(model, opt, [collate([docs[i] for i in idx])], lc.lr_at(s, 3e-3, 30, steps))
        bar.set_postfix(loss=f"{out['loss']:.3f}", refresh=False)
    return cfg, model.state_numpy()


def run_backend(name: str, out: Path, cfg, base: dict, tok, train_ex, valid_ex, test_contexts, recipe) -> dict:
    """LoRA training and beam search in one backend; returns timings and outputs.

    Timings separate first use from steady state: jittor compiles each kernel the first
    time it runs (minutes on a fresh machine, cached afterwards), torch does not. Training:
    wall seconds, the first update's seconds and the median seconds per update (the trainer's
    ``ms_per_batch``, evaluation and checkpoints excluded). Beam search: a warm-up decode of
    two contexts for 4 tokens first (kernels compiled there), then the timed full decode."""
    backend = lc.get_backend(name)
    shutil.rmtree(out / name, ignore_errors=True)  # the demo's own run folder from an earlier call
    model = backend.build_model(cfg, recipe.train.lora_config(), base)
    t0 = time.time()
    result = train(backend, model, train_ex, valid_ex, recipe.train, out / name, base_note="demo base")
    t1 = time.time()
    step_ms = [r["ms_per_batch"] for r in read_log(out / name / "log.jsonl") if r["kind"] == "train"]
    warm_cfg = dataclasses.replace(recipe.beam, max_new_tokens=4)
    decode_contexts(backend, model, tok, test_contexts[:2], warm_cfg, batch_size=10, progress=False)
    t2 = time.time()
    beams = decode_contexts(backend, model, tok, test_contexts, recipe.beam, batch_size=10)
    t3 = time.time()
    write_beam_jsonl(out / name / "beam.jsonl", beams)
    return {"result": result, "train_s": t1 - t0, "train_first_step_s": step_ms[0] / 1000,
            "train_step_ms": float(np.median(step_ms[1:] or step_ms)), "beam_warmup_s": t2 - t1,
            "beam_s": t3 - t2, "beams": beams}


def score(out: Path, name: str, tok, test_records: list[dict]) -> dict:
    import eval as evaluator

    d = out / name
    make_eval_files(tok, d / "beam.jsonl", test_records, "e2e", d / "ref.txt", d / "pred.txt")
    try:
        return evaluator.score_e2e(d / "ref.txt", d / "pred.txt")
    except evaluator.JavaUnavailableError as e:  # no Java: the metrics that need none, named as such
        print(f"note: {e}")
        return evaluator.score_e2e(d / "ref.txt", d / "pred.txt", metrics=["BLEU", "NIST", "ROUGE_L", "CIDEr"])


def parity_report(out: Path, runs: dict, scores: dict) -> dict:
    """Loss differences per step, identical beams, metric differences (torch is the reference)."""
    logs = {n: {r["step"]: r["loss"] for r in read_log(out / n / "log.jsonl") if r["kind"] == "train"} for n in runs}
    timing_keys = ("train_s", "train_first_step_s", "train_step_ms", "beam_warmup_s", "beam_s")
    rep = {"backends": list(runs), "scores": scores,
           **{k: {n: round(r[k], 3) for n, r in runs.items()} for k in timing_keys}}
    if len(runs) == 2:
        a, b = list(runs)
        steps = sorted(set(logs[a]) & set(logs[b]))
        rel = [abs(logs[a][s] - logs[b][s]) / abs(logs[a][s]) for s in steps]
        same = [x == y for x, y in zip(runs[a]["beams"], runs[b]["beams"])]
        rep.update({"steps_compared": len(steps), "max_rel_loss_diff": max(rel), "mean_rel_loss_diff": float(np.mean(rel)),
                    "identical_beams": f"{sum(same)}/{len(same)}", "identical_beam_share": sum(same) / len(same),
                    "metric_diff": {k: abs(scores[a][k] - scores[b][k]) for k in scores[a] if k in scores[b]},
                    # steady state, b relative to a (> 1: b is faster): per update, and full decode after warm-up
                    "speed_ratio": {"train": runs[a]["train_step_ms"] / runs[b]["train_step_ms"],
                                    "beam": runs[a]["beam_s"] / runs[b]["beam_s"]}})
    write_text_atomic(out / "parity.json", json.dumps(rep, indent=2) + "\n")
    write_text_atomic(out / "parity.md", _markdown(rep))
    return rep


def _markdown(rep: dict) -> str:
    names = rep["backends"]
    lines = ["| | " + " | ".join(names) + (" | difference |" if len(names) == 2 else " |"),
             "| --- |" + " --- |" * (len(names) + (len(names) == 2))]
    for k in rep["scores"][names[0]]:
        diff = f" | {rep['metric_diff'][k]:.2e}" if len(names) == 2 else ""
        lines.append(f"| {k} | " + " | ".join(f"{rep['scores'][n][k]:.4f}" for n in names) + diff + " |")
    rows = (("train_step_ms", "train ms/update, steady state (median)"),
            ("train_s", "train seconds, wall (first use included)"),
            ("train_first_step_s", "of which the first update, seconds (jittor compiles)"),
            ("beam_s", "beam seconds, steady state (after warm-up)"),
            ("beam_warmup_s", "beam warm-up seconds (2 inputs, 4 tokens; jittor compiles)"))
    for key, label in rows:
        ratio = ""
        if len(names) == 2 and key in ("train_step_ms", "beam_s"):
            ratio = f" {names[1]} speed {rep['speed_ratio']['train' if key == 'train_step_ms' else 'beam']:.2f}x {names[0]} |"
        lines.append(f"| {label} | " + " | ".join(f"{rep[key][n]:.2f}" for n in names) + (f" |{ratio or ' |'}" if len(names) == 2 else " |"))
    if len(names) == 2:
        lines += ["", f"- training loss, {rep['steps_compared']} steps: max relative difference "
                  f"{rep['max_rel_loss_diff']:.2e} (mean {rep['mean_rel_loss_diff']:.2e})",
                  f"- identical beam outputs: {rep['identical_beams']} ({100 * rep['identical_beam_share']:.0f}%)",
                  "- speed: compare the steady-state rows. Jittor compiles each kernel on first use (minutes on a "
                  "fresh machine, cached in $JITTOR_HOME afterwards); that time is in the wall, first-update and "
                  "warm-up rows only. Wall training time also includes validation and checkpoints."]
    return "\n".join(lines) + "\n"


def write_samples(out: Path, groups, runs: dict, tok, n: int = 5) -> str:
    lines = []
    for g, i in zip(groups[:n], range(n)):
        lines.append(f"- MR: `{g.context}`")
        for name, r in runs.items():
            toks = [t for t in r["beams"][i] if t not in tok.stop_ids]
            lines.append(f"  - {name}: {tok.decode(toks).strip()}")
        lines.append(f"  - reference: {g.references[0]}")
    text = "\n".join(lines) + "\n"
    write_text_atomic(out / "samples.md", text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.nlg.demo", description=doc_summary(__doc__))
    p.add_argument("--out", type=Path, default=Path("runs/demo"))
    p.add_argument("--data-dir", type=Path, help="real data (e2e/*.txt; the demo trains its own 1,024-token BPE on it); default: the toy set")
    p.add_argument("--backends", default="torch,jittor")
    p.add_argument("--pretrain-steps", type=int, default=500)
    p.add_argument("--steps", type=int, default=300, help="LoRA training steps per backend")
    p.add_argument("--test-limit", type=int, default=50, help="test MRs to decode (0: all)")
    p.add_argument("--preset", default="demo", help="GPT-2 size preset for the base")
    p.add_argument("--threads", type=int, default=1,
                   help="threads for torch and jittor (default 1: the figures depend on it, see pin_threads)")
    a = p.parse_args(argv)
    if a.threads < 1:
        p.error(f"--threads must be >= 1, got {a.threads}")
    if a.test_limit < 0:  # a slice's negative stop would drop MRs from the end
        p.error(f"--test-limit must be >= 0 (0: every test MR), got {a.test_limit}")
    pin_threads(a.threads)
    t_start = time.time()
    tok, recs, data_name = prepare_data(a.out, a.data_dir)
    groups = group_references(recs["test"])[: a.test_limit or None]
    try:  # E2E scoring at the end cannot hold one MR of several references: refused before any training
        check_e2e_groups(groups, f"--test-limit {a.test_limit}")
    except ValueError as e:
        p.error(str(e))
    half = len(recs["train"]) // 2
    cfg, base = pretrain_base(tok, recs["train"][:half], a.pretrain_steps, a.preset)
    lc.save_model(a.out / "base", cfg, base)
    recipe = get_recipe("toy")
    recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, max_steps=a.steps),
                                 beam=dataclasses.replace(recipe.beam, stop_ids=tok.stop_ids))
    enc = {s: encode_file(tok, r) for s, r in recs.items()}
    test_records = [{"context": g.context, "completion": ref} for g in groups for ref in g.references]
    runs, scores = {}, {}
    for name in a.backends.split(","):
        runs[name] = run_backend(name, a.out, cfg, base, tok, enc["train"][half:], enc["valid"],
                                 [g.context for g in groups], recipe)
        scores[name] = score(a.out, name, tok, test_records)
    rep = parity_report(a.out, runs, scores)
    from .plot import plot
    plot([a.out / n / "log.jsonl" for n in runs], list(runs), a.out / "loss_curves.png",
         title=f"LoRA on the {data_name} data: torch vs jittor")
    print(write_samples(a.out, groups, runs, tok))
    print((a.out / "parity.md").read_text())
    print(f"demo finished in {time.time() - t_start:.0f} s; outputs in {a.out}/")
    return 0 if rep else 1


if __name__ == "__main__":
    raise SystemExit(main())
