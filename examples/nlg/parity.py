"""Pipeline parity, torch vs jittor, on E2E: training losses per step and beam outputs.

    python -m examples.nlg.parity --data-dir ../shared/data --steps 200 --test-mrs 50 [--dropout 0.1]

From the same initial weights (a random ``tiny`` GPT-2 with the GPT-2 vocabulary, the same
seeded LoRA init) and the same data order, both backends train ``--steps`` LoRA updates on
E2E (with ``--dropout`` > 0 the LoRA dropout masks come from one shared numpy stream:
``dropout_masks=numpy``), then beam-decode ``--test-mrs`` test MRs. Prints and writes
(``--out``/parity.json) the maximum per-step relative loss difference and the share of
token-identical beam outputs. Issue bounds: 1e-3 relative and >= 98% identical.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import lora_core as lc
from lora_core.data import convert_e2e, group_references
from lora_core.recipes import get_recipe
from lora_core.tokenizer import encode_file, load_tokenizer
from lora_core.trainer import read_log, train

from .beam import decode_contexts


def run(data_dir: Path, out: Path, steps: int, test_mrs: int, dropout: float, n_train: int = 2000,
        preset: str = "tiny", progress: bool = True) -> dict:
    tok = load_tokenizer(data_dir / "gpt2-vocab")
    train_recs = convert_e2e(data_dir / "e2e" / "train.txt")[:n_train]
    groups = group_references(convert_e2e(data_dir / "e2e" / "test.txt"))[:test_mrs]
    enc = encode_file(tok, train_recs)
    cfg = lc.gpt2_config(preset, vocab_size=tok.vocab_size, n_positions=256)
    base = lc.init_gpt2_weights(cfg, seed=0)
    recipe = get_recipe("e2e-medium")
    tcfg = dataclasses.replace(recipe.train, max_steps=steps, lr=2e-3, warmup=20, lora_dropout=dropout,
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
    p = argparse.ArgumentParser(prog="python -m examples.nlg.parity", description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    p.add_argument("--out", type=Path, default=Path("runs/parity"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--test-mrs", type=int, default=50)
    p.add_argument("--dropout", type=float, default=0.0)
    a = p.parse_args(argv)
    rep = run(a.data_dir, a.out, a.steps, a.test_mrs, a.dropout)
    print(json.dumps(rep, indent=2))
    ok = rep["max_rel_loss_diff"] <= 1e-3 and rep["identical_share"] >= 0.98
    print("PASS" if ok else "FAIL", "(bounds: loss 1e-3 relative, >= 98% identical beams)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
