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
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from .tokenizer import EOS_TOKEN, Tokenizer, load_tokenizer

__all__ = ["read_utf8", "read_documents", "load_text_tokenizer", "pack_blocks", "check_tokenizer_fits", "tokenize_documents"]


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


def check_tokenizer_fits(vocab_size: int, model_vocab: int, what: str = "the tokenizer", fix: str = "") -> None:
    """Refuse a tokenizer whose ids do not fit the model's embedding (a different model's
    tokenizer); a model may have more rows than the tokenizer (padded vocabularies). ``fix`` is
    appended to the message (the option that fixes it, where the caller knows one)."""
    if vocab_size > model_vocab:
        raise ValueError(f"{what} has {vocab_size} tokens but the model's vocabulary has {model_vocab}: "
                         f"not this model's tokenizer{fix}")
