"""Masked-LM pre-training of a small random DistilBERT on the SST-2 training sentences.

No pretrained DistilBERT can be downloaded here, so the CPU demo pre-trains its own small
base: ``transformers``' ``DistilBertForMaskedLM`` (the class of the real
``distilbert-base-uncased`` checkpoint), BERT's masking (Devlin et al. 2019: 15% of the
tokens other than ``[CLS]``/``[SEP]``/``[PAD]`` are predicted; of those 80% become
``[MASK]``, 10% a random token, 10% stay), AdamW with linear warm-up and decay
(``lora_core.train.schedule``), batches of shuffled sentences of similar length padded to their
longest. The MLM head runs on the masked positions only: the same loss as
``DistilBertForMaskedLM(..., labels=...)`` (a test checks), without the (B, T, 30522) logits
of the other positions. For a budget of about a minute: no dropout while pre-training
(Geiping & Goldstein 2022, "Cramming"; ``config.json`` still says DistilBERT's 0.1 for
fine-tuning) and the output bias starts at the tokens' log frequency (``unigram_log_prior``).

Reproducible: masks and batch order come from a seeded numpy generator, the initial
weights from ``torch.manual_seed(seed)`` (inside ``torch.random.fork_rng``: the caller's
torch RNG is left as it was), one thread (restored afterwards), so two runs give
bit-identical weights. The output folder is written whole or not at all (a temp folder
beside it, then ``os.replace``)::

    out/sst2/base/config.json         HF DistilBertConfig (architectures: DistilBertForMaskedLM)
    out/sst2/base/model.safetensors   save_pretrained's file, loads with from_pretrained
    out/sst2/base/log.jsonl           {"step", "loss", "lr", "masked_accuracy"}, means since the last line
    out/sst2/base/pretrain.json       the settings, sentence count and run time

    python -m examples.cls.pretrain --prepared out/sst2 --out-dir out/sst2/base
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from lora_core.data.nlg import DataFormatError, read_jsonl
from lora_core.formats.checkpoint import write_json_atomic
from lora_core.train.schedule import linear_warmup_decay

from ..run_options import doc_summary

# BERT uncased vocab.txt (distilbert-base-uncased): 30522 WordPieces, these special ids.
VOCAB_SIZE, PAD_ID, CLS_ID, SEP_ID, MASK_ID = 30522, 0, 101, 102, 103
FINETUNE_DROPOUT = 0.1  # DistilBERT's dropout and attention_dropout, written to config.json
# Demo defaults, measured on one core at 46e8aaf (figures in the commit that set them):
# 2 layers of width 64, 3200 steps of 32 sentences, about 2.5 min. LoRA
# (r=4, q_lin/v_lin + head, 600 updates, lr 1e-3) on it reaches 59% SST-2 dev accuracy
# (3 seeds), on the same random base 53%; after 1600 steps (70 s) only 55%.
DEFAULTS = dict(dim=64, n_layers=2, n_heads=2, hidden_dim=256, steps=3200, batch_size=32, lr=1e-3,
                warmup=320, weight_decay=0.01, dropout=0.0, max_len=128, log_every=50)  # fmt: skip
HELP = dict(dim="model width", n_layers="transformer layers", n_heads="attention heads", hidden_dim="FFN width",
            steps="AdamW updates", batch_size="sentences per update", lr="peak learning rate",
            warmup="updates of linear warm-up", weight_decay="AdamW weight decay", dropout="dropout probability",
            max_len="longest sentence in tokens (longer ones refused)", log_every="updates between log lines")  # fmt: skip


def mask_tokens(
    ids: np.ndarray, rng: np.random.Generator, vocab_size: int = VOCAB_SIZE, mask_prob: float = 0.15
) -> tuple[np.ndarray, np.ndarray]:
    """BERT's masking of a padded batch.

    Args:
        ids: (B, T) int64 token ids, ``PAD_ID`` on padding.
        rng: the seeded generator (the only source of randomness).

    Returns:
        ``(inputs, labels)``: (B, T) corrupted ids and the original id at each selected
        position, -100 elsewhere (at least one position is selected).
    """
    candidate = (ids != PAD_ID) & (ids != CLS_ID) & (ids != SEP_ID)
    selected = candidate & (rng.random(ids.shape) < mask_prob)
    if not selected.any() and candidate.any():  # a tiny batch: predict one token anyway
        selected.flat[rng.choice(np.flatnonzero(candidate))] = True
    labels = np.where(selected, ids, -100)
    u = rng.random(ids.shape)
    inputs = np.where(selected & (u < 0.8), MASK_ID, ids)
    swap = selected & (u >= 0.8) & (u < 0.9)
    inputs = np.where(swap, rng.integers(0, vocab_size, ids.shape), inputs)
    return inputs.astype(np.int64), labels.astype(np.int64)


def mlm_loss(model, input_ids, attention_mask, labels):
    """``DistilBertForMaskedLM``'s loss (mean cross-entropy over the selected positions),
    its head (vocab_transform, activation, vocab_layer_norm, vocab_projector) applied to
    those positions only. Returns ``(loss, n_correct, n_selected)``."""
    import torch.nn.functional as F

    hidden = model.distilbert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, E)
    sel = labels != -100
    h = model.vocab_layer_norm(model.activation(model.vocab_transform(hidden[sel])))  # (M, E)
    logits = model.vocab_projector(h)  # (M, V)
    target = labels[sel]
    return F.cross_entropy(logits, target), int((logits.argmax(-1) == target).sum()), int(target.numel())


def _sentence_problem(s, vocab_size: int, max_len: int) -> str | None:
    if not isinstance(s, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in s):
        return f"expected a list of int token ids, got {str(s)[:60]}"
    if len(s) < 3:
        return f"{len(s)} tokens; expected [CLS], at least one token, [SEP]"
    if len(s) > max_len:
        return f"{len(s)} tokens > max_len={max_len} (prepare with --max-len {max_len}, or raise max_len)"
    bad = [t for t in s if not 0 <= t < vocab_size]
    return f"token id {bad[0]} outside [0, {vocab_size})" if bad else None


def check_sentences(train_ids: list[list[int]], vocab_size: int = VOCAB_SIZE, max_len: int = 128) -> None:
    """Raise ``ValueError`` naming the first bad sentence (0-based index) and its problem."""
    if not train_ids:
        raise ValueError("no training sentences")
    for i, s in enumerate(train_ids):
        problem = _sentence_problem(s, vocab_size, max_len)
        if problem:
            raise ValueError(f"sentence {i}: {problem}")


def read_train_ids(path: str | os.PathLike, vocab_size: int = VOCAB_SIZE, max_len: int = 128) -> list[list[int]]:
    """The ``ids`` of a prepared ``train.jsonl``; a bad line raises ``DataFormatError`` naming it."""
    ids = []
    for line, rec in enumerate(read_jsonl(path), start=1):
        problem = "no 'ids' field" if "ids" not in rec else _sentence_problem(rec["ids"], vocab_size, max_len)
        if problem:
            raise DataFormatError(path, line, problem)
        ids.append(rec["ids"])
    if not ids:
        raise DataFormatError(path, None, "no sentences")
    return ids


def _check_settings(s: dict) -> None:
    for k in ("dim", "n_layers", "n_heads", "hidden_dim", "steps", "batch_size", "max_len", "log_every", "vocab_size"):
        if not isinstance(s[k], int) or isinstance(s[k], bool) or s[k] < 1:
            raise ValueError(f"{k} must be an int >= 1, got {s[k]!r}")
    if s["dim"] % s["n_heads"]:
        raise ValueError(f"dim={s['dim']} is not divisible by n_heads={s['n_heads']}")
    if not (isinstance(s["warmup"], int) and 0 <= s["warmup"] < s["steps"]):
        raise ValueError(f"warmup must be an int in [0, steps={s['steps']}), got {s['warmup']!r}")
    if not 0.0 <= s["dropout"] < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {s['dropout']!r}")
    if not s["lr"] > 0 or not s["weight_decay"] >= 0:
        raise ValueError(f"lr must be > 0 and weight_decay >= 0, got {s['lr']!r}, {s['weight_decay']!r}")


def unigram_log_prior(train_ids: list[list[int]], vocab_size: int, smoothing: float = 0.1) -> np.ndarray:
    """Log frequency of each token among the predicted ones (all but ``[CLS]``/``[SEP]``/``[PAD]``),
    add-``smoothing``: the MLM head's initial output bias. A model then starts at the unigram
    loss instead of ln(vocab_size) (Karpathy's "init well": the last layer's bias at the data's
    log prior); with Adam's ~lr steps per parameter the bias alone would take thousands of
    updates to get there."""
    tokens = np.concatenate([np.asarray(s, dtype=np.int64) for s in train_ids])
    tokens = tokens[(tokens != PAD_ID) & (tokens != CLS_ID) & (tokens != SEP_ID)]
    counts = np.bincount(tokens, minlength=vocab_size).astype(np.float64) + smoothing
    return np.log(counts / counts.sum()).astype(np.float32)


def _batches(lengths: np.ndarray, batch_size: int, rng: np.random.Generator, group: int = 50):
    """Index arrays of ``batch_size`` sentences, forever: each epoch a new permutation, cut
    into chunks of ``group`` batches sorted by length inside (little padding), the batches
    then shuffled (``transformers``' ``LengthGroupedSampler`` idea). A last partial batch
    of an epoch is dropped (those sentences are in other epochs' permutations)."""
    n = len(lengths)
    size = min(batch_size, n)
    while True:
        order = rng.permutation(n)
        chunks = [order[s : s + group * size] for s in range(0, n, group * size)]
        sorted_order = np.concatenate([c[np.argsort(-lengths[c], kind="stable")] for c in chunks])
        batches = [sorted_order[s : s + size] for s in range(0, n - size + 1, size)]
        for b in rng.permutation(len(batches)):
            yield batches[b]


def _optimizer(model, lr: float, weight_decay: float):
    """torch AdamW; no decay on biases and LayerNorm weights (BERT's rule)."""
    import torch

    decay, no_decay = [], []
    for n, p in model.named_parameters():  # tied vocab_projector.weight is listed once
        (no_decay if n.endswith("bias") or "norm" in n.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr)


def _train(model, train_ids, s: dict, log_path: Path, progress: bool) -> dict:
    """The update loop; writes ``log_path`` (loss and masked accuracy: means over the updates
    since the previous line); returns the last line's record."""
    import torch
    from tqdm import tqdm

    from lora_core.data.cls_data import collate

    rng = np.random.default_rng(s["seed"])
    opt = _optimizer(model, s["lr"], s["weight_decay"])
    batches = _batches(np.array([len(t) for t in train_ids]), s["batch_size"], rng)
    model.train()
    acc = {"loss": 0.0, "correct": 0, "n": 0, "steps": 0}
    record = {}
    bar = tqdm(range(s["steps"]), desc="pre-train (MLM)", unit="step", disable=not progress)
    with open(log_path, "w", encoding="utf-8") as log:
        for step in bar:
            batch = collate([train_ids[i] for i in next(batches)])
            inputs, labels = mask_tokens(batch["input_ids"], rng, s["vocab_size"])
            lr = linear_warmup_decay(step + 1, s["lr"], s["warmup"], s["steps"] + 1)
            for g in opt.param_groups:
                g["lr"] = lr
            loss, correct, n = mlm_loss(model, torch.from_numpy(inputs), torch.from_numpy(batch["attention_mask"]),
                                        torch.from_numpy(labels))  # fmt: skip
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            acc = {"loss": acc["loss"] + loss.item(), "correct": acc["correct"] + correct, "n": acc["n"] + n,
                   "steps": acc["steps"] + 1}  # fmt: skip
            if (step + 1) % s["log_every"] == 0 or step + 1 == s["steps"]:
                record = {"step": step + 1, "loss": acc["loss"] / acc["steps"], "lr": lr,
                          "masked_accuracy": acc["correct"] / acc["n"]}  # fmt: skip
                log.write(json.dumps(record) + "\n")
                log.flush()
                bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['masked_accuracy']:.3f}")
                acc = {"loss": 0.0, "correct": 0, "n": 0, "steps": 0}
    return record


def _hf_config(s: dict, dropout: float):
    import transformers

    return transformers.DistilBertConfig(
        vocab_size=s["vocab_size"], max_position_embeddings=s["max_len"], dim=s["dim"], n_layers=s["n_layers"],
        n_heads=s["n_heads"], hidden_dim=s["hidden_dim"], pad_token_id=PAD_ID, dropout=dropout,
        attention_dropout=dropout,
    )  # fmt: skip


def _fsync_folder(folder: Path) -> None:
    for p in folder.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())


def pretrain_mlm(
    train_ids: list[list[int]],
    out_dir: str | os.PathLike,
    *,
    dim: int = DEFAULTS["dim"],
    n_layers: int = DEFAULTS["n_layers"],
    n_heads: int = DEFAULTS["n_heads"],
    hidden_dim: int = DEFAULTS["hidden_dim"],
    steps: int = DEFAULTS["steps"],
    batch_size: int = DEFAULTS["batch_size"],
    lr: float = DEFAULTS["lr"],
    warmup: int = DEFAULTS["warmup"],
    weight_decay: float = DEFAULTS["weight_decay"],
    max_len: int = DEFAULTS["max_len"],
    vocab_size: int = VOCAB_SIZE,
    dropout: float = DEFAULTS["dropout"],
    seed: int = 0,
    log_every: int = DEFAULTS["log_every"],
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Pre-train a random ``DistilBertForMaskedLM`` and save it as a HF folder.

    Args:
        train_ids: token ids per sentence (``[CLS] ... [SEP]``, BERT uncased vocabulary).
        out_dir: the folder to write (must not exist or be empty unless ``overwrite``).
        dim, n_layers, n_heads, hidden_dim: the architecture (HF ``DistilBertConfig`` names).
        steps, batch_size, lr, warmup, weight_decay: AdamW updates of ``batch_size``
            sentences, lr warmed up linearly over ``warmup`` updates then decayed to 0.
        max_len: ``max_position_embeddings``; a longer sentence is an error, not cut.
        dropout: dropout and attention dropout while pre-training (0: none, as Cramming's
            short-budget recipe); ``config.json`` gets DistilBERT's 0.1 for fine-tuning.
        seed: masks, batch order (numpy) and initial weights (torch).
        log_every: a ``log.jsonl`` line (means over the interval) every this many updates.

    Returns:
        ``out_dir`` as a ``Path``.
    """
    import torch
    import transformers

    settings = dict(dim=dim, n_layers=n_layers, n_heads=n_heads, hidden_dim=hidden_dim, steps=steps,
                    batch_size=batch_size, lr=lr, warmup=warmup, weight_decay=weight_decay, max_len=max_len,
                    vocab_size=vocab_size, dropout=dropout, seed=seed, log_every=log_every)  # fmt: skip
    _check_settings(settings)
    check_sentences(train_ids, vocab_size, max_len)
    out_dir = Path(out_dir)
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())) and not overwrite:
        raise FileExistsError(f"{out_dir}: exists and is not empty (pass overwrite=True / --overwrite)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"  # mkdir: the umask's mode
    tmp.mkdir()
    threads, t0 = torch.get_num_threads(), time.perf_counter()
    try:
        torch.set_num_threads(1)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = transformers.DistilBertForMaskedLM(_hf_config(settings, settings["dropout"]))
            with torch.no_grad():
                model.vocab_projector.bias.copy_(torch.from_numpy(unigram_log_prior(train_ids, vocab_size)))
            last = _train(model, train_ids, settings, tmp / "log.jsonl", progress)
        model.config.dropout = model.config.attention_dropout = FINETUNE_DROPOUT  # what config.json tells users
        model.save_pretrained(tmp, safe_serialization=True)
        if not (tmp / "model.safetensors").is_file():
            raise RuntimeError(f"{tmp}: save_pretrained wrote no model.safetensors")
        summary = {"settings": settings, "sentences": len(train_ids), "seconds": round(time.perf_counter() - t0, 1),
                   "final": last, "transformers": transformers.__version__, "torch": torch.__version__}  # fmt: skip
        write_json_atomic(tmp / "pretrain.json", summary)
        _fsync_folder(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.cls.pretrain", description=doc_summary(__doc__),
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--prepared", type=Path, required=True, help="output folder of examples.cls.prepare (train.jsonl)")
    ap.add_argument("--out-dir", type=Path, required=True, help="where the base (config.json + model.safetensors) goes")
    for k, v in DEFAULTS.items():
        if k == "warmup":  # a tenth of --steps unless given (320 of the default 3200)
            ap.add_argument("--warmup", type=int, default=None, help=f"{HELP[k]} (None: --steps // 10)")
        else:
            ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v, help=HELP[k])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out-dir")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.warmup is None:
        args.warmup = max(0, args.steps // 10)
    elif args.steps >= 1 and not 0 <= args.warmup < args.steps:
        print(f"error: --warmup must be in [0, --steps={args.steps}), got {args.warmup}", file=sys.stderr)
        return 2
    train = args.prepared / "train.jsonl"
    try:
        if not train.is_file():
            raise FileNotFoundError(f"{train}: no such file (run examples.cls.prepare first)")
        ids = read_train_ids(train, VOCAB_SIZE, args.max_len)
        kw = {k: getattr(args, k) for k in DEFAULTS}
        out = pretrain_mlm(ids, args.out_dir, seed=args.seed, overwrite=args.overwrite,
                           progress=not args.no_progress, **kw)  # fmt: skip
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = json.loads((out / "pretrain.json").read_text(encoding="utf-8"))
    print(f"{out}: {summary['sentences']} sentences, {args.steps} steps in {summary['seconds']} s, "
          f"last loss {summary['final']['loss']:.3f}, masked accuracy {summary['final']['masked_accuracy']:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
