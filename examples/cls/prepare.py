"""SST-2 TSV -> encoded JSONL (``{"ids": [...], "label": 0|1}``, test: ``{"index", "ids"}``).

WordPiece with ``tokenizers`` from BERT's uncased ``vocab.txt`` (``[CLS] ... [SEP]``, the ids
``transformers``' ``DistilBertTokenizer`` gives); no padding here: batches are padded to their
longest sentence when formed. Sentences longer than ``--max-len`` tokens are cut and counted
in the printed summary. A bad file stops with its name and line (``lora_core.data.cls_data``)::

    python -m examples.cls.prepare --data-dir ../shared/data/sst2 \\
        --vocab ../shared/data/distilbert-vocab/vocab.txt --out-dir out/sst2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lora_core.data import cls_data
from lora_core.data.nlg import write_jsonl_atomic
from lora_core.train.run_dir import check_out_dir

from ..run_options import doc_summary

SPLITS = {"train": True, "dev": True, "test": False}  # split -> labelled


def prepare(data_dir: Path, vocab: Path, out_dir: Path, max_len: int = 128) -> dict:
    """Encode every split; returns ``{split: {"n", "cut", "max_tokens"}}``."""
    if max_len < 2:
        raise ValueError(f"--max-len {max_len}: a sentence takes at least 2 tokens ([CLS] and [SEP])")
    tok = cls_data.wordpiece_tokenizer(vocab)
    rows = {s: cls_data.read_tsv(data_dir / f"{s}.tsv", labelled) for s, labelled in SPLITS.items()}  # all read first
    summary, records = {}, {}
    for split, labelled in SPLITS.items():  # all encoded (and checked) before any file is written
        ids, cut = cls_data.encode(tok, [s for s, _ in rows[split]], max_len, source=data_dir / f"{split}.tsv")
        if labelled:
            records[split] = [{"ids": i, "label": lab} for i, (_, lab) in zip(ids, rows[split])]
        else:
            records[split] = [{"index": index, "ids": i} for i, (_, index) in zip(ids, rows[split])]
        summary[split] = {"n": len(ids), "cut": cut, "max_tokens": max(map(len, ids), default=0)}
    for split, recs in records.items():
        write_jsonl_atomic(out_dir / f"{split}.jsonl", recs)
    return summary


def read_prepared(path: Path, with_index: bool = False):
    """``(ids, labels)`` of a prepared split (labels None for test); ``with_index``: also the
    test split's GLUE indices (``None`` for a labelled split; older files without them: 0..n-1;
    ``"index"`` on every line or on none). A line that is not such a record raises
    ``cls_data.DataError`` naming the file and line."""
    ids, labels, indices, seen, indexed = [], [], [], {}, False
    with open(path, "rb") as f:
        for no, raw in enumerate(f, start=1):
            try:
                r = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise cls_data.DataError(f"{path}:{no}: not UTF-8 text") from None
            except json.JSONDecodeError as e:
                raise cls_data.DataError(f"{path}:{no}: not JSON ({e.msg})") from None
            seq = r.get("ids") if isinstance(r, dict) else None
            if not isinstance(seq, list) or not seq or not all(type(t) is int and t >= 0 for t in seq):
                raise cls_data.DataError(f"{path}:{no}: no 'ids' list of token ids")
            if no > 1 and ("label" in r) != (labels is not None):
                raise cls_data.DataError(f"{path}:{no}: 'label' present on some lines and not on others")
            if no == 1 and "label" not in r:
                labels = None
            if labels is not None:
                if r["label"] not in (0, 1) or type(r["label"]) is not int:
                    raise cls_data.DataError(f"{path}:{no}: label {r['label']!r} is not 0 or 1")
                labels.append(r["label"])
            else:
                if no == 1:
                    indexed = "index" in r
                elif ("index" in r) != indexed:  # a line without it would get its line number, silently
                    raise cls_data.DataError(f"{path}:{no}: 'index' present on some lines and not on others")
                index = r.get("index", no - 1)
                if type(index) is not int or index < 0:
                    raise cls_data.DataError(f"{path}:{no}: index {index!r} is not a whole number")
                if index in seen:  # a submission file holds each GLUE index once
                    raise cls_data.DataError(f"{path}:{no}: index {index} again (line {seen[index]} has it)")
                seen[index] = no
                indices.append(index)
            ids.append(seq)
    if not ids:
        raise cls_data.DataError(f"{path}: the file is empty (no example)")
    return (ids, labels, None if labels is not None else indices) if with_index else (ids, labels)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.cls.prepare", description=doc_summary(__doc__))
    ap.add_argument("--data-dir", type=Path, required=True, help="folder with train.tsv, dev.tsv, test.tsv")
    ap.add_argument("--vocab", type=Path, required=True, help="BERT uncased vocab.txt")
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--max-len", type=int, default=128)
    args = ap.parse_args(argv)
    try:
        check_out_dir(args.out_dir, resume=True)  # before any work; resume: no run here, old files may stay
        summary = prepare(args.data_dir, args.vocab, args.out_dir, args.max_len)
    except (ValueError, OSError) as e:  # DataError is a ValueError; a missing file or a folder an OSError
        print(f"error: {e}", file=sys.stderr)
        return 2
    for split, s in summary.items():
        print(f"{split}: {s['n']} sentences, longest {s['max_tokens']} tokens, {s['cut']} cut to {args.max_len}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
