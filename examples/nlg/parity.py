"""Pipeline parity, torch vs jittor, on E2E: training losses per step and beam outputs.

    python -m examples.nlg.parity --data-dir ../shared/data --steps 200 --test-mrs 50 [--dropout 0.1]

A small base is made first (no pretrained GPT-2 can be downloaded): a byte-level BPE of
``--vocab-size`` tokens trained on the E2E training texts (``lora_core.data.toy.train_toy_tokenizer``;
with GPT-2's 50,257 tokens a CPU cannot pre-train a useful base in minutes) and the
``demo``-size GPT-2 pre-trained (torch, full fine-tuning, ``--pretrain-steps``) as a plain
LM on ``MR => text`` documents of the first E2E training examples, as the demo does. A
random or barely trained base emits eos at once, which would make identical beams vacuous. From that base, the
same seeded LoRA init and the same data order, both backends train ``--steps`` LoRA updates on
the other E2E examples (with ``--dropout`` > 0 the LoRA dropout masks come from one shared numpy stream:
``dropout_masks=numpy``), then beam-decode ``--test-mrs`` test MRs. Prints and writes
(``--out``/parity.json) the maximum per-step relative loss difference and the share of
token-identical beam outputs. Issue bounds: 1e-3 relative and >= 98% identical.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

import lora_core as lc
from lora_core.data.convert import convert_e2e
from lora_core.data.nlg import group_references
from lora_core.data.tokenizer import encode_file, load_tokenizer
from lora_core.data.toy import train_toy_tokenizer
from lora_core.train.recipes import get_recipe
from lora_core.train.trainer import read_log, train

from ..run_options import doc_summary
from .beam import decode_contexts
from .demo import pretrain_base


def run(data_dir: Path, out: Path, steps: int, test_mrs: int, dropouts=(0.0,), n_pre: int = 3500,
        pretrain_steps: int = 400, preset: str = "demo", vocab_size: int = 1024, progress: bool = True) -> list[dict]:
    """One report per dropout value (the tokenizer and base are made once)."""
    recs = convert_e2e(data_dir / "e2e" / "train.txt")
    texts = [t for r in recs for t in (r["context"], " " + r["completion"])]
    out.mkdir(parents=True, exist_ok=True)
    train_toy_tokenizer(texts, vocab_size).save(str(out / "tokenizer.json"))
    tok = load_tokenizer(out / "tokenizer.json")
    groups = group_references(convert_e2e(data_dir / "e2e" / "test.txt"))[:test_mrs]
    enc = encode_file(tok, recs[n_pre:])
    cfg, base = pretrain_base(tok, recs[:n_pre], pretrain_steps, preset, progress=progress)
    return [_compare(tok, cfg, base, enc, groups, out / f"dropout{d}", steps, d, progress) for d in dropouts]


def _compare(tok, cfg, base, enc, groups, out: Path, steps: int, dropout: float, progress: bool) -> dict:
    for name in ("torch", "jittor"):  # this command's own run folders from an earlier call
        shutil.rmtree(out / name, ignore_errors=True)
    recipe = get_recipe("e2e-medium")
    tcfg = dataclasses.replace(recipe.train, max_steps=steps, lr=1e-3, warmup=20, lora_dropout=dropout,
                               dropout_masks="numpy", eval_every=0, save_every=0, log_every=1, seed=1)
    beam_cfg = dataclasses.replace(recipe.beam, stop_ids=tok.stop_ids)
    logs, beams = {}, {}
    for name in ("torch", "jittor"):
        backend = lc.get_backend(name)
        model = backend.build_model(cfg, tcfg.lora_config(), base)
        train(backend, model, enc, None, tcfg, out / name, progress=progress)
        logs[name] = [r["loss"] for r in read_log(out / name / "log.jsonl") if r["kind"] == "train"]
        beams[name] = decode_contexts(backend, model, tok, [g.context for g in groups], beam_cfg, 10, progress)
    rel = [abs(a - b) / abs(a) for a, b in zip(logs["torch"], logs["jittor"], strict=True)]
    same = sum(a == b for a, b in zip(beams["torch"], beams["jittor"], strict=True))
    rep = {"steps": len(rel), "dropout": dropout, "max_rel_loss_diff": max(rel), "first_loss": logs["torch"][0],
           "last_loss": logs["torch"][-1], "identical_beams": same, "test_mrs": len(groups),
           "identical_share": same / len(groups),
           "mean_generated_len": sum(map(len, beams["torch"])) / len(groups)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "parity.json").write_text(json.dumps(rep, indent=2) + "\n")
    return rep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.nlg.parity", description=doc_summary(__doc__))
    p.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    p.add_argument("--out", type=Path, default=Path("runs/parity"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--test-mrs", type=int, default=50)
    p.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1])
    p.add_argument("--pretrain-steps", type=int, default=400)
    a = p.parse_args(argv)
    reps = run(a.data_dir, a.out, a.steps, a.test_mrs, a.dropout, pretrain_steps=a.pretrain_steps)
    print(json.dumps(reps, indent=2))
    ok = all(r["max_rel_loss_diff"] <= 1e-3 and r["identical_share"] >= 0.98 for r in reps)
    print("PASS" if ok else "FAIL", "(bounds: loss 1e-3 relative, >= 98% identical beams)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
