"""Sentence classification data (GLUE SST-2): strict TSV reading, BERT WordPiece
tokenisation with ``tokenizers``, dynamic padding.

GLUE's SST-2 files: ``train.tsv`` / ``dev.tsv`` with header ``sentence\\tlabel`` (label 0 or
1), ``test.tsv`` with header ``index\\tsentence`` (no labels). A wrong header, a line
without its fields or a label outside {0, 1} raises one error naming file and line.
Tokens are ``[CLS] wordpieces [SEP]`` (``distilbert-base-uncased``'s ``vocab.txt``, lower
case); sentences longer than ``max_len`` tokens are cut there, and the number cut is
returned, never hidden. Batches are padded to their longest sentence (dynamic padding).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

LABELLED_HEADER, TEST_HEADER = ["sentence", "label"], ["index", "sentence"]


class DataError(ValueError):
    """A data file that is not what it should be: names the file, line and problem."""


def read_tsv(path: str | os.PathLike, labelled: bool = True) -> list[tuple[str, int]]:
    """``[(sentence, label)]`` of an SST-2 TSV; for ``test.tsv`` (``labelled=False``)
    ``[(sentence, index)]``, GLUE's index of each sentence (a submission names it)."""
    header = LABELLED_HEADER if labelled else TEST_HEADER
    raw = Path(path).read_bytes()  # a missing file or a folder: OSError naming it
    try:
        lines = raw.decode("utf-8").split("\n")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x})") from None
    if lines and lines[-1] == "":
        lines.pop()
    if not lines or lines[0].split("\t") != header:
        got = lines[0].split("\t") if lines else "an empty file"
        raise DataError(f"{path}:1: expected the header {chr(9).join(header)!r}, got {got!r}")
    out = []
    for no, line in enumerate(lines[1:], start=2):
        fields = line.split("\t")
        if len(fields) != 2:
            raise DataError(f"{path}:{no}: expected 2 tab-separated fields, got {len(fields)}")
        if labelled:
            sentence, label = fields
            if label not in ("0", "1"):
                raise DataError(f"{path}:{no}: label {label!r} is not 0 or 1")
            out.append((sentence.strip(), int(label)))
        else:
            index, sentence = fields
            if not index.isdigit() or not index.isascii():
                raise DataError(f"{path}:{no}: index {index!r} is not a whole number")
            out.append((sentence.strip(), int(index)))
        if not out[-1][0]:  # it would encode to [CLS] [SEP] alone, and train (or be judged) as a sentence
            raise DataError(f"{path}:{no}: empty sentence")
    if not out:  # it would prepare an empty split: nothing to train on, judge or predict
        raise DataError(f"{path}: no sentence after the header")
    if not labelled:
        seen: dict[int, int] = {}
        for no, (_, index) in enumerate(out, start=2):
            if seen.setdefault(index, no) != no:
                raise DataError(f"{path}:{no}: index {index} again (line {seen[index]} has it)")
    return out


def wordpiece_tokenizer(vocab_path: str | os.PathLike, lowercase: bool = True):
    """BERT's uncased WordPiece tokenizer (``tokenizers``) from a ``vocab.txt``; encodes to
    ``[CLS] ... [SEP]``."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    if not Path(vocab_path).exists():
        raise DataError(f"{vocab_path}: no such vocabulary file (a BERT vocab.txt)")
    if not Path(vocab_path).is_file():
        raise DataError(f"{vocab_path}: not a file (a BERT vocab.txt expected)")
    try:
        tok = Tokenizer(WordPiece.from_file(str(vocab_path), unk_token="[UNK]"))
    except Exception as e:  # tokenizers raises a bare Exception
        raise DataError(f"{vocab_path}: not a WordPiece vocab.txt ({e})") from None
    tok.normalizer = normalizers.BertNormalizer(
        lowercase=lowercase, strip_accents=None, clean_text=True, handle_chinese_chars=True
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    if cls is None or sep is None or tok.token_to_id("[PAD]") != 0:
        raise DataError(f"{vocab_path}: not a BERT vocabulary ([CLS], [SEP] and [PAD]=0 expected)")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return tok


def encode(
    tokenizer, sentences: list[str], max_len: int = 128, source: str | os.PathLike | None = None
) -> tuple[list[list[int]], int]:
    """Token ids per sentence, cut to ``max_len`` (keeping ``[SEP]`` last), and how many were cut.
    ``max_len`` must hold ``[CLS]`` and ``[SEP]`` (>= 2). A sentence that encodes to no token
    between them (only characters the tokenizer drops: a zero-width space, control characters)
    raises ``DataError``; ``source``: the TSV the sentences were read from (``read_tsv``:
    sentence ``i`` on line ``i + 2``), named with the line."""
    if max_len < 2:
        raise ValueError(f"max_len={max_len}: a sequence holds at least [CLS] and [SEP] (2 tokens)")
    ids, cut = [], 0
    sep = tokenizer.token_to_id("[SEP]")
    for i, enc in enumerate(tokenizer.encode_batch(sentences)):
        seq = enc.ids
        if len(seq) <= 2:  # [CLS] [SEP] alone: it would train (or be judged) as a sentence
            where = f"{source}:{i + 2}" if source is not None else f"sentence {i + 1}"
            raise DataError(
                f"{where}: no token between [CLS] and [SEP] (the sentence {sentences[i][:40]!r} "
                "holds only characters the tokenizer drops)"
            )
        if len(seq) > max_len:
            seq, cut = seq[: max_len - 1] + [sep], cut + 1
        ids.append(seq)
    return ids, cut


def collate(ids: list[list[int]], labels: list[int] | None = None, pad_id: int = 0) -> dict:
    """A batch padded to its longest sequence: ``input_ids``, ``attention_mask`` (B, T)
    int64, and ``labels`` (B,) when given."""
    T = max(len(s) for s in ids)
    input_ids = np.full((len(ids), T), pad_id, dtype=np.int64)
    mask = np.zeros((len(ids), T), dtype=np.int64)
    for i, s in enumerate(ids):
        input_ids[i, : len(s)], mask[i, : len(s)] = s, 1
    batch = {"input_ids": input_ids, "attention_mask": mask}
    if labels is not None:
        batch["labels"] = np.asarray(labels, dtype=np.int64)
    return batch


def accuracy(pred: np.ndarray, labels) -> float:
    labels = np.asarray(labels)
    return float((np.asarray(pred) == labels).mean()) if labels.size else float("nan")


__all__ = ["DataError", "accuracy", "collate", "encode", "read_tsv", "wordpiece_tokenizer"]
