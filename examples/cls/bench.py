"""Speed and memory of DistilBERT + LoRA on SST-2 batches: our torch and jittor backends
against HF ``transformers`` + ``peft`` (the framework comparison of the DistilBERT/SST-2 study).

Recipe of the study: LoRA r=4, alpha 8 on ``q_lin`` and ``v_lin``, the classifier trained
fully (peft's ``modules_to_save=["classifier"]``, which by its suffix rule also trains
``pre_classifier``, in every system), AdamW lr 2e-4, weight decay 0.01, eps 1e-8, batch 16 with
gradient accumulation 2 (an update = 2 micro-batches of 16), dropout as configured (0.1,
0.2 before the classifier). Batches are the first SST-2 training sentences in file order,
WordPiece-tokenised (``lora_core.data.cls_data``) and padded to their longest sentence. Every
(system, repeat) runs in its own process, so its peak RSS (``ru_maxrss``) is its own;
systems rotate per repeat; the table gives medians. Every system starts from the same
weights: random ones of the shape, or ``--base`` (a HF DistilBERT folder, e.g. the demo's
pre-trained base or ``distilbert-base-uncased``; a head-less checkpoint gets the same seeded
head everywhere) and the same LoRA init (our seeded numpy draws, copied into peft's layers);
``--no-dropout`` turns dropout off everywhere, so the three train the same up to rounding. After the timed updates each system predicts the whole dev set (872
sentences, batches of 64): eval examples/s and dev accuracy after the same updates.

    python -m examples.cls.bench --data-dir ../shared/data --json cls_bench.json
    python -m examples.cls.bench --base runs/cls-demo/base --steps 30   # accuracy that means something
    # smoke run: --shape tiny --steps 1 --warmup 1 --repeats 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import lora_core as lc
from lora_core.data import cls_data
from lora_core.models.distilbert import PRESETS, DistilBertConfig, init_head, init_weights, load_distilbert_checkpoint

from ..bench_worker import check_outputs, environment, environment_line, run_as_worker, spawn, write_output
from ..nlg.bench import _names, code_version
from ..run_options import doc_summary

SYSTEMS = ("ours-torch", "ours-jittor", "hf-peft")
BATCH, ACCUM, EVAL_BATCH, LR = 16, 2, 64, 2e-4
TARGETS = [  # (label, metric, numerator, denominator, "ge"/"le", bound)
    ("train ex/s   ours-torch / hf-peft", "train_ex_s", "ours-torch", "hf-peft", "ge", 1.3),
    ("train ex/s   ours-jittor / ours-torch", "train_ex_s", "ours-jittor", "ours-torch", "ge", 0.9),
    ("peak RSS     ours-torch / hf-peft", "rss_mb", "ours-torch", "hf-peft", "le", 1.0),
    ("peak RSS     ours-jittor / hf-peft", "rss_mb", "ours-jittor", "hf-peft", "le", 1.0),
]


DISTILBERT = PRESETS["distilbert-base-uncased"]


def shape_config(name: str) -> DistilBertConfig:
    """``distilbert``: distilbert-base-uncased's shape; ``tiny`` with BERT's vocabulary."""
    return DISTILBERT if name == "distilbert" else DistilBertConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=128)


def start_weights(shape: str, base: str | None) -> tuple[DistilBertConfig, dict]:
    """The shape's random weights, or ``base``'s (with ``init_head(cfg, 0)`` if it has no head)."""
    if not base:
        cfg = shape_config(shape)
        return cfg, init_weights(cfg, seed=0)
    cfg, tensors, has_head = load_distilbert_checkpoint(base, num_labels=2)
    return cfg, tensors if has_head else dict(tensors, **init_head(cfg, 0))


def batches(data_dir: Path, n: int | None, size: int, split: str = "train") -> list[dict]:
    """The first ``n`` sentences of the split (all: None) in batches of ``size``; a split with
    fewer than ``n`` is refused naming it (the steps would get short or empty batches)."""
    path = data_dir / "sst2" / f"{split}.tsv"
    rows = cls_data.read_tsv(path)
    if n is not None and len(rows) < n:
        raise ValueError(f"{path}: {len(rows)} sentences; the bench's steps take {n} (batch x accumulation x (warmup + steps))")
    rows = rows[:n]
    tok = cls_data.wordpiece_tokenizer(data_dir / "distilbert-vocab" / "vocab.txt")
    ids, _ = cls_data.encode(tok, [s for s, _ in rows], max_len=128)
    return [cls_data.collate(ids[i : i + size], [lab for _, lab in rows[i : i + size]]) for i in range(0, len(rows), size)]


TARGETS_CFG = lc.LoRATargetConfig(r=4, alpha=8, target_modules=("q_lin", "v_lin"), modules_to_save=("classifier",))


def share_lora_init(peft_model, cfg: lc.LoRATargetConfig = TARGETS_CFG) -> None:
    """Give a peft model the LoRA init our backends draw for ``cfg`` (``init_lora_arrays``,
    seeded per module name): every system then starts from the same numbers, not only the
    same base."""
    import torch

    from lora_core.lora.targeting import LayerPlan, init_lora_arrays

    prefix = "base_model.model."
    mods = {n[len(prefix) :]: m for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    scaling = cfg.alpha / cfg.r
    plans = {n: LayerPlan(n, "linear", m.in_features, m.out_features, cfg.r, cfg.alpha, scaling) for n, m in mods.items()}
    values = init_lora_arrays(plans, cfg.seed)
    with torch.no_grad():
        for n, m in mods.items():
            m.lora_A["default"].weight.copy_(torch.from_numpy(values[f"{n}.lora_A"]))
            m.lora_B["default"].weight.copy_(torch.from_numpy(values[f"{n}.lora_B"]))


def without_dropout(cfg: DistilBertConfig) -> DistilBertConfig:
    return dataclasses.replace(cfg, dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0)


class Ours:
    def __init__(self, name: str, cfg: DistilBertConfig, weights: dict):
        self.bk = lc.get_backend(name)
        self.model = self.bk.DistilBertForSequenceClassification(cfg)
        self.model.load_weights(weights)
        self.bk.inject_lora(self.model, TARGETS_CFG)
        self.opt = self.bk.AdamW(self.bk.trainable_parameters(self.model), lc.optim.AdamWConfig(weight_decay=0.01, eps=1e-8))

    def train_step(self, micro: list[dict]) -> float:
        return self.bk.cls_train_step(self.model, self.opt, micro, LR)["loss"]

    def predict(self, batch: dict) -> np.ndarray:
        return self.bk.cls_predict(self.model, batch)


class HFPeft:
    def __init__(self, cfg: DistilBertConfig, weights: dict):
        import peft
        import torch
        import transformers

        hf_cfg = transformers.DistilBertConfig(**{k: v for k, v in cfg.to_dict().items() if k != "initializer_range"})
        model = transformers.DistilBertForSequenceClassification(hf_cfg)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
        t = TARGETS_CFG
        lcfg = peft.LoraConfig(r=t.r, lora_alpha=t.alpha, target_modules=list(t.target_modules),
                               modules_to_save=list(t.modules_to_save))  # fmt: skip
        self.torch, self.model = torch, peft.get_peft_model(model, lcfg)
        share_lora_init(self.model)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01)

    def _t(self, b: dict) -> dict:
        return {k: self.torch.from_numpy(v) for k, v in b.items()}

    def train_step(self, micro: list[dict]) -> float:
        self.model.train()
        total = 0.0
        for mb in micro:
            loss = self.model(**self._t(mb)).loss
            (loss / len(micro)).backward()
            total += loss.item()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total / len(micro)

    def predict(self, batch: dict) -> np.ndarray:
        self.model.eval()
        with self.torch.no_grad():
            b = self._t(batch)
            return self.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.argmax(-1).numpy()


def run_worker(spec: dict) -> dict:
    if spec["system"] != "ours-jittor":
        import torch

        torch.set_num_threads(spec["threads"])
    data_dir, (cfg, weights) = Path(spec["data_dir"]), start_weights(spec["shape"], spec.get("base"))
    if spec.get("no_dropout"):
        cfg = without_dropout(cfg)
    train = batches(data_dir, BATCH * ACCUM * (spec["warmup"] + spec["steps"]), BATCH)
    dev = batches(data_dir, None, EVAL_BATCH, "dev")
    name = spec["system"]
    system = HFPeft(cfg, weights) if name == "hf-peft" else Ours(name.split("-")[1], cfg, weights)
    times, losses = [], []
    for i in range(spec["warmup"] + spec["steps"]):
        t0 = time.perf_counter()
        losses.append(system.train_step(train[i * ACCUM : (i + 1) * ACCUM]))
        times.append(time.perf_counter() - t0)
        print(f"[bench] {spec['system']} update {i + 1}: {times[-1]:.2f} s", file=sys.stderr, flush=True)
    system.predict(dev[0])  # warm-up
    t0 = time.perf_counter()
    correct = sum(int((system.predict(b) == b["labels"]).sum()) for b in dev)
    eval_s = time.perf_counter() - t0
    n_dev = sum(len(b["labels"]) for b in dev)
    return {"train_ex_s": BATCH * ACCUM * spec["steps"] / sum(times[spec["warmup"] :]), "loss": losses,
            "eval_ex_s": n_dev / eval_s, "dev_accuracy": correct / n_dev, "update_s": times,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "loadavg_end": os.getloadavg()[0], "distilbert_shape": cfg.dim == DISTILBERT.dim
            and cfg.n_layers == DISTILBERT.n_layers and cfg.hidden_dim == DISTILBERT.hidden_dim}  # fmt: skip


def summarise(raw: dict) -> str:
    keys = ("train_ex_s", "eval_ex_s", "rss_mb", "dev_accuracy")
    good = {s: [r for r in runs if "error" not in r] for s, runs in raw.items()}  # a failed run is left out, not its system
    med = {s: {k: statistics.median(r[k] for r in runs) for k in keys} for s, runs in good.items() if runs}
    lines = ["| system | train ex/s | eval ex/s | peak RSS MB | dev accuracy |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {s} | {m['train_ex_s']:.2f} | {m['eval_ex_s']:.1f} | {m['rss_mb']:.0f} | {m['dev_accuracy']:.4f} |"
              for s, m in med.items()]  # fmt: skip
    lines += ["", "| target | bound | measured | met |", "| --- | --- | --- | --- |"]
    at_shape = all(r.get("distilbert_shape") for runs in raw.values() for r in runs)
    for label, key, num, den, kind, bound in TARGETS:
        if num in med and den in med:
            ratio = med[num][key] / med[den][key]
            ok = ratio >= bound if kind == "ge" else ratio <= bound
            met = ("yes" if ok else "no") if at_shape else "info (the targets are for the distilbert shape)"
            lines.append(f"| {label} | {'>=' if kind == 'ge' else '<='} {bound} | {ratio:.2f} | {met} |")
        elif num in raw and den in raw:  # both systems ran, one has no run without an error
            lines.append(f"| {label} | {'>=' if kind == 'ge' else '<='} {bound} | n/a | n/a (no run of "
                         f"{' or '.join(x for x in (num, den) if x not in med)} without an error) |")
    failed = [f"- {s} run {i + 1}: {r['error']}" for s, runs in raw.items() for i, r in enumerate(runs) if "error" in r]
    lines += ["", "errors (these runs are left out of the tables):", *failed] if failed else []
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.cls.bench", description=doc_summary(__doc__))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--data-dir", type=Path, default=Path(__file__).resolve().parents[3] / "shared" / "data")
    ap.add_argument("--shape", choices=("distilbert", "tiny"), default="distilbert")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--steps", type=int, default=3, help="timed updates (of 2 x 16 examples)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--base", type=Path, help="HF DistilBERT folder every system starts from (default: random)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-dropout", action="store_true",
                    help="dropout off in every system (with the shared LoRA init: the same training in all three)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.worker:
        return run_as_worker(run_worker, args.worker)
    try:
        systems = _names(args.systems, tuple(SYSTEMS), "--systems")
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if min(args.steps, args.repeats, args.threads) < 1 or args.warmup < 0:
        ap.error(f"--steps, --repeats and --threads must be >= 1, --warmup >= 0 (got {args.steps}, {args.repeats}, "
                 f"{args.threads}, {args.warmup})")
    wrong = check_outputs(json=args.json)
    if wrong:
        ap.error(wrong)
    env, version = environment(), code_version()
    raw = {s: [] for s in systems}
    for rep in range(args.repeats):
        for s in systems[rep % len(systems) :] + systems[: rep % len(systems)]:
            spec = {"system": s, "shape": args.shape, "data_dir": str(args.data_dir), "steps": args.steps,
                    "warmup": args.warmup, "threads": args.threads, "base": str(args.base or ""),
                    "no_dropout": args.no_dropout}  # fmt: skip
            load = os.getloadavg()[0]
            raw[s].append(dict(spawn("examples.cls.bench", spec, args.threads), loadavg_start=load))
    table = summarise(raw)
    print(environment_line(env))
    print(table)
    print(f"\n(code {version}; command: python -m examples.cls.bench {' '.join(sys.argv[1:] if argv is None else argv)})")
    if args.json:
        write_output(args.json, json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "code": version, "environment": env,
                                         "raw": raw}, indent=1))
    return 0 if all("error" not in r for runs in raw.values() for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
