"""Plain-text corpora for causal-LM training (wikitext-2 and the like): strict reading,
tokenising with the model's tokenizer, packing into fixed blocks.

Layout (transformers' ``run_clm.py`` ``group_texts``, with documents marked): each input file
is one document; documents are concatenated in the order given, each followed by the
tokenizer's end-of-text token (so a block that crosses a boundary still says where one
document ends), and the stream is cut into consecutive blocks of ``block_size`` tokens.
Unlike ``group_texts`` the remainder is kept: the last block may be shorter (a remainder of a
single token, which would predict nothing, takes the last token of the block before it, so
that no block is longer than ``block_size``: that token is then read, not predicted). Every
token of the stream is in exactly one block, in order (``pack_blocks`` checks it).

A block trains as ``(block[:1], block[1:])`` (``lora_core.train.tasks.LMTask``): the model reads
``block[:-1]`` and predicts every token after the first, the loss ``run_clm`` computes on the
same block.

A prepared folder (``examples.lm.prepare``) is a set of three files: ``train.jsonl`` and
``valid.jsonl`` (``{"ids": [...]}`` per block) and ``meta.json`` (tokenizer, vocabulary size,
end-of-text id, block size, block and token counts, and the SHA-256 of each JSONL file).
:func:`write_prepared` removes ``meta.json`` first and writes it last, so a run that fails
half-way leaves no set; :func:`read_prepared` refuses a folder whose files are not the ones its
``meta.json`` describes (a mix of two preparations).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from .tokenizer import EOS_TOKEN, Tokenizer, load_tokenizer

__all__ = ["read_utf8", "read_documents", "load_text_tokenizer", "pack_blocks", "check_tokenizer_fits", "tokenize_documents",
           "model_eos_ids", "write_prepared", "read_prepared", "PREPARED_SPLITS"]


def read_utf8(path: str | os.PathLike, what: str = "text to train on") -> str:
    """The text of one file, strictly: a missing file, a folder, a file that is not UTF-8 (the
    message names the line and column) or holds only whitespace raises ValueError naming the
    file (``what``: what the empty file lacks, for the message)."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{p}: no such file")
    if not p.is_file():
        raise ValueError(f"{p}: not a file")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"{p}: line {line}, column {col}: not UTF-8 text (byte 0x{raw[e.start]:02x})") from None
    if not text.strip():
        raise ValueError(f"{p}: empty file (no {what})")
    return text


def read_documents(paths: Sequence[str | os.PathLike], what: str = "text to train on") -> list[tuple[str, str]]:
    """``(path, text)`` of each file, strictly (:func:`read_utf8`; ``what``: what an empty file lacks)."""
    if not paths:
        raise ValueError("no text files given")
    return [(str(p), read_utf8(p, what)) for p in map(Path, paths)]


def load_text_tokenizer(spec: str | os.PathLike) -> Tokenizer:
    """The model's tokenizer: GPT-2's BPE folder (``encoder.json`` + ``vocab.bpe``), or a
    ``tokenizer.json`` (file, or a checkpoint folder holding one) through ``tokenizers``; the
    end-of-text token is the folder's ``tokenizer_config.json`` ``eos_token`` when it has one
    (Llama 3: ``<|end_of_text|>``, Llama 2 / Mistral: ``</s>``), else GPT-2's."""
    path = Path(spec)
    folder = path if path.is_dir() else path.parent
    eos = EOS_TOKEN
    tc = folder / "tokenizer_config.json"
    if tc.is_file():
        from ..formats.tensor_files import read_json

        tok = read_json(tc).get("eos_token")
        eos = tok.get("content", eos) if isinstance(tok, dict) else tok or eos
    return load_tokenizer(path, eos)


def tokenize_documents(tok: Tokenizer, docs: Sequence[tuple[str, str]]) -> list[list[int]]:
    """Token ids of each document (no special tokens added). A document whose text holds the
    end-of-text token's own text is refused naming its file and line: the tokenizer encodes that
    text as the token itself, which the packing puts between documents only."""
    for name, text in docs:
        at = text.find(tok.eos_token)
        if at >= 0:
            raise ValueError(f"{name}: line {text.count(chr(10), 0, at) + 1}: holds the end-of-text token's text "
                             f"{tok.eos_token!r}, which would read as a document boundary: remove it, or end the "
                             f"file there and give the rest as another file")  # fmt: skip
    return tok.encode_batch([text for _, text in docs])


def pack_blocks(docs_ids: Sequence[Sequence[int]], block_size: int, eos_id: int | None) -> list[list[int]]:
    """Cut the documents, each followed by ``eos_id`` (None: nothing between them), into
    consecutive blocks of ``block_size`` tokens (see the module docstring)."""
    if not isinstance(block_size, int) or block_size < 3:
        raise ValueError(f"--block-size must be an int >= 3 (tokens read and predicted; a remainder of one token "
                         f"takes one from the block before it, which must keep two), got {block_size!r}")
    stream: list[int] = []
    for ids in docs_ids:
        stream.extend(ids)
        if eos_id is not None:
            stream.append(eos_id)
    blocks = [stream[s : s + block_size] for s in range(0, len(stream), block_size)]
    if len(blocks) > 1 and len(blocks[-1]) == 1:  # (block_size - 1, 2): never longer than block_size
        blocks[-1] = blocks[-2][-1:] + blocks[-1]
        blocks[-2] = blocks[-2][:-1]
    if not blocks or len(blocks[-1]) < 2:
        raise ValueError(f"{len(stream)} token(s) in all: nothing to predict")
    if sum(len(b) for b in blocks) != len(stream) or [t for b in blocks for t in b] != stream:
        raise AssertionError("pack_blocks lost or repeated a token")  # the documented invariant
    return blocks


# a model's embedding may have more rows than its tokenizer has tokens (rounded up for the GEMMs:
# Qwen2 0.2%, Phi-2 1.8%, GPT-NeoX 0.3% more); a tokenizer covering less than this share of the
# rows is another, smaller model's
MIN_TOKENIZER_COVERAGE = 0.9


def model_eos_ids(config) -> tuple[int, ...] | None:
    """The end-of-text ids a model's config names (``eos_token_id``: an int or a list, as in
    transformers' Llama-family ``config.json``), or None where it names none (GPT-2's config
    here keeps no such field: GPT-2 checkpoints all use ``<|endoftext|>``)."""
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return None
    ids = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    return tuple(int(i) for i in ids if i is not None) or None


def check_tokenizer_fits(vocab_size: int, model_vocab: int, what: str = "the tokenizer", fix: str = "",
                         eos_id: int | None = None, model_eos: Sequence[int] | None = None) -> None:
    """Refuse a tokenizer that is not the model's: its ids do not fit the embedding; it covers
    less than ``MIN_TOKENIZER_COVERAGE`` of the embedding's rows (a model may have a few more rows
    than its tokenizer's tokens: padded vocabularies); or its end-of-text id ``eos_id`` is not
    one of the ``model_eos`` ids the model's config names (where both are known). ``fix`` is
    appended to the message (the option that fixes it, where the caller knows one)."""
    if vocab_size > model_vocab:
        raise ValueError(f"{what} has {vocab_size} tokens but the model's vocabulary has {model_vocab}: "
                         f"not this model's tokenizer{fix}")
    if vocab_size < MIN_TOKENIZER_COVERAGE * model_vocab:
        raise ValueError(f"{what} has {vocab_size} tokens but the model's vocabulary has {model_vocab} "
                         f"({model_vocab - vocab_size} rows no token would reach; a padded vocabulary adds a few "
                         f"percent): not this model's tokenizer{fix}")  # fmt: skip
    if eos_id is not None and model_eos and eos_id not in model_eos:
        names = model_eos[0] if len(model_eos) == 1 else list(model_eos)
        raise ValueError(f"{what} ends a text with token id {eos_id} but the model's config names eos_token_id "
                         f"{names}: not this model's tokenizer{fix}")  # fmt: skip


PREPARED_SPLITS = ("train", "valid")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_prepared(out_dir: str | os.PathLike, blocks: dict[str, list[list[int]]], meta: dict) -> dict:
    """Write a prepared folder (module docstring): ``blocks`` of each split in
    ``PREPARED_SPLITS``; ``meta`` gains the block and token counts and the files' SHA-256.
    ``meta.json`` goes first and comes back last: a failure in between leaves a folder that
    :func:`read_prepared` refuses, never a mix of two preparations. Returns the meta written."""
    from .nlg import jsonl_text, write_text_atomic

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    meta = dict(meta, sha256={})
    for split in PREPARED_SPLITS:
        text = jsonl_text({"ids": b} for b in blocks[split])
        write_text_atomic(out / f"{split}.jsonl", text)
        meta[f"{split}_blocks"] = len(blocks[split])
        meta[f"{split}_tokens"] = sum(map(len, blocks[split]))
        meta["sha256"][f"{split}.jsonl"] = _sha256(text.encode("utf-8"))
    write_text_atomic(out / "meta.json", json.dumps(meta, indent=1) + "\n")
    return meta


def read_prepared(prepared: str | os.PathLike, option: str = "--prepared") -> tuple[list[dict], list[dict], dict]:
    """The training and validation blocks of a prepared folder and its ``meta.json``, checked:
    every block a list of at least two token ids below the vocabulary size and no longer than the
    block size; the files the ones ``meta.json`` describes (their SHA-256, or in a folder written
    before the digests were kept, their block counts). Each problem raises ValueError (or
    FileNotFoundError) naming the file."""
    from ..formats.tensor_files import read_json
    from .nlg import check_data_file, read_jsonl

    prepared = Path(prepared)
    again = "run examples.lm.prepare again"
    if prepared.exists() and not prepared.is_dir():
        raise ValueError(f"{option} {prepared}: a file, not a folder (the output folder of examples.lm.prepare)")
    meta_path = prepared / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path}: no such file (run examples.lm.prepare first; a preparation that "
                                f"failed half-way leaves none)")  # fmt: skip
    meta = read_json(meta_path)
    if type(meta.get("vocab_size")) is not int or meta["vocab_size"] < 1:
        raise ValueError(f"{meta_path}: no 'vocab_size' (a positive int: the tokenizer's size) in it; {again}")
    for key in ("block_size", *(f"{s}_blocks" for s in PREPARED_SPLITS)):
        if type(meta.get(key)) is not int or meta[key] < 1:
            raise ValueError(f"{meta_path}: no '{key}' (a positive int) in it; {again}")
    digests = meta.get("sha256")
    out = []
    for split in PREPARED_SPLITS:
        path = check_data_file(prepared / f"{split}.jsonl", hint="run examples.lm.prepare first")
        recs = read_jsonl(path)
        for i, r in enumerate(recs, 1):
            ids = r.get("ids")
            if not isinstance(ids, list) or len(ids) < 2 or not all(type(t) is int and t >= 0 for t in ids):
                raise ValueError(f"{path}: line {i}: 'ids' must be a list of at least 2 token ids")
            if len(ids) > meta["block_size"]:
                raise ValueError(f"{path}: line {i}: a block of {len(ids)} tokens, longer than the block size "
                                 f"{meta['block_size']} of {meta_path}; {again}")  # fmt: skip
            if max(ids) >= meta["vocab_size"]:
                raise ValueError(f"{path}: line {i}: token id {max(ids)} is not below the vocabulary size "
                                 f"{meta['vocab_size']} of {meta_path}; {again}")  # fmt: skip
        if len(recs) != meta[f"{split}_blocks"]:
            raise ValueError(f"{path}: {len(recs)} blocks, but {meta_path} says {meta[f'{split}_blocks']}: the folder "
                             f"mixes two preparations; {again}")  # fmt: skip
        if isinstance(digests, dict) and _sha256(path.read_bytes()) != digests.get(path.name):
            raise ValueError(f"{path}: not the file {meta_path} describes (its SHA-256 differs: the folder mixes two "
                             f"preparations, or the file was changed); {again}")  # fmt: skip
        out.append(recs)
    return out[0], out[1], meta
