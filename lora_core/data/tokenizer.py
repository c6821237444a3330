"""Byte-level BPE tokenizer (GPT-2's, or the toy data set's) and the paper's example encoding.

Wraps the HF ``tokenizers`` library; imports neither torch nor jittor.

Sequence layout of the LoRA paper code (microsoft/LoRA ``examples/NLG/src/gpt2_encode.py``
run with ``--add_bos --add_eos``): ``context_ids = bpe(context) + [eos]`` and
``completion_ids = bpe(" " + completion) + [eos]``, with eos = ``<|endoftext|>``
(50256 for GPT-2). The beam search stops on :attr:`Tokenizer.stop_ids`, GPT-2's
``(50256, 628)`` where 628 is ``"\\n\\n"`` (gpt2_beam.py ``--eos_token_id 628``).

One difference from OpenAI's ``encoder.py`` used by the paper: the literal text
``<|endoftext|>`` inside a string encodes to the eos id here (as in HF
``GPT2TokenizerFast``), not to its characters; no line of E2E, WebNLG or DART holds it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

__all__ = ["EOS_TOKEN", "Tokenizer", "load_tokenizer", "encode_example", "encode_file"]

EOS_TOKEN = "<|endoftext|>"
_DOUBLE_NEWLINE = "\u010a\u010a"  # byte-level spelling of "\n\n" (GPT-2 id 628)


class Tokenizer:
    """A byte-level BPE tokenizer with the ids the pipeline needs.

    Attributes:
        eos_id: id of ``<|endoftext|>`` (appended to context and completion).
        stop_ids: ids that end a generation: eos, then the single ``"\\n\\n"`` token
            when the vocabulary has one.
        vocab_size: number of ids, added tokens included (50257 for GPT-2).
    """

    def __init__(self, backend: tokenizers.Tokenizer, eos_token: str = EOS_TOKEN):
        # a tokenizer.json may carry truncation or padding settings: they would cut texts or pad a
        # batch's ids here (transformers switches them off per call unless asked): off
        backend.no_truncation()
        backend.no_padding()
        self.backend = backend
        eos_id = backend.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"eos token {eos_token!r} is not in the vocabulary")
        self.eos_token = eos_token
        self.eos_id: int = eos_id
        nn_id = backend.token_to_id(_DOUBLE_NEWLINE)
        self.stop_ids: tuple[int, ...] = (eos_id,) if nn_id is None else (eos_id, nn_id)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """BPE ids of ``text``; no special tokens added."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """:meth:`encode` with what the tokenizer's post-processor puts before the text (Llama 3's
        ``<|begin_of_text|>``, Llama 2's ``<s>``), as transformers' ``tokenizer(prompt)`` gives a
        generation; an end-of-text token it would append is left out (generation continues the text)."""
        enc = self.backend.encode(text, add_special_tokens=True)
        ids = enc.ids
        if ids[-1:] == [self.eos_id] and enc.special_tokens_mask[-1]:  # the post-processor's, not the text's
            ids = ids[:-1]
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` over many texts at once (multi-threaded in ``tokenizers``)."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are kept as text (like the paper's ``enc.decode``)."""
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def save(self, path: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` to ``path``."""
        self.backend.save(str(path))

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, stop_ids={self.stop_ids})"


def _from_vocab_files(encoder_json: Path, vocab_bpe: Path) -> tokenizers.Tokenizer:
    """GPT-2's BPE from OpenAI's ``encoder.json`` + ``vocab.bpe`` (as gpt2_encode.py reads them)."""
    backend = tokenizers.Tokenizer(models.BPE.from_file(str(encoder_json), str(vocab_bpe)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([EOS_TOKEN])  # already in encoder.json: keeps its id 50256
    return backend


def load_tokenizer(spec: str | os.PathLike, eos_token: str = EOS_TOKEN) -> Tokenizer:
    """Load a byte-level BPE tokenizer.

    Args:
        spec: a folder holding ``tokenizer.json`` or ``encoder.json`` + ``vocab.bpe``
            (``tokenizer.json`` wins when both are there), a path to a
            ``tokenizer.json`` file, or a Hugging Face hub name such as ``"gpt2"``
            (needs internet; tried only when ``spec`` is not an existing path).
        eos_token: the end-of-text token.

    Raises:
        FileNotFoundError: when a folder holds neither kind of vocabulary files or
            ``spec`` is neither a path nor a loadable hub name.
        ValueError: when ``eos_token`` is not in the vocabulary.
    """
    path = Path(spec)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return _named(_tokenizer_file(path / "tokenizer.json"), eos_token, path)
        if (path / "encoder.json").is_file() and (path / "vocab.bpe").is_file():
            try:
                backend = _from_vocab_files(path / "encoder.json", path / "vocab.bpe")
            except Exception as e:  # tokenizers raises a bare Exception for a damaged file
                raise ValueError(f"{path}: encoder.json + vocab.bpe do not make a BPE tokenizer ({e})") from None
            return _named(backend, eos_token, path)
        raise FileNotFoundError(f"{path}: holds neither tokenizer.json nor encoder.json + vocab.bpe")
    if path.is_file():
        return _named(_tokenizer_file(path), eos_token, path)
    if path.is_absolute() or str(spec).startswith((".", "~")) or len(path.parts) > 2:  # a path, not a hub name
        raise FileNotFoundError(f"{spec}: no such tokenizer file or folder")
    try:
        backend = tokenizers.Tokenizer.from_pretrained(str(spec))
    except Exception as e:  # tokenizers raises a bare Exception for hub failures
        raise FileNotFoundError(
            f"{spec}: no such tokenizer file or folder, and loading it from the Hugging Face hub failed: {e}"
        ) from None
    return _named(backend, eos_token, spec)


def _tokenizer_file(path: Path):
    """``tokenizers.Tokenizer.from_file``; a file it cannot read (not JSON, not a tokenizer) is a
    ValueError naming it (tokenizers raises a bare Exception)."""
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:
        raise ValueError(f"{path}: not a tokenizers tokenizer.json ({e})") from None


def _named(backend, eos_token: str, where) -> Tokenizer:
    """``Tokenizer(backend, eos_token)``; a missing end-of-text token names the tokenizer."""
    if not isinstance(eos_token, str) or not eos_token:
        raise ValueError(f"{where}: the end-of-text token must be a non-empty string (tokenizer_config.json's "
                         f"eos_token), got {eos_token!r}")
    try:
        return Tokenizer(backend, eos_token)
    except ValueError as e:
        raise ValueError(f"{where}: {e} (the end-of-text token: tokenizer_config.json's eos_token beside it, "
                         f"else GPT-2's '<|endoftext|>')") from None  # fmt: skip


def encode_example(tok: Tokenizer, context: str, completion: str) -> tuple[list[int], list[int]]:
    """Paper layout: ``(bpe(context) + [eos], bpe(" " + completion) + [eos])``."""
    return tok.encode(context) + [tok.eos_id], tok.encode(" " + completion) + [tok.eos_id]


def encode_file(tok: Tokenizer, records: Sequence[dict], batch_size: int = 4096, progress: bool = False) -> list[dict]:
    """Encode formatted records with :func:`encode_example`'s layout, batched.

    Args:
        tok: the tokenizer.
        records: ``{"context": str, "completion": str[, "cate": bool]}`` dicts.
        batch_size: texts per ``encode_batch`` call.
        progress: show a tqdm bar.

    Returns:
        ``{"context": ids, "completion": ids}`` per record, ``cate`` kept when present.
    """
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(records), desc="encode", unit="ex")
    out = []
    eos = [tok.eos_id]
    for s in range(0, len(records), batch_size):
        chunk = records[s : s + batch_size]
        ctx = tok.encode_batch([r["context"] for r in chunk])
        comp = tok.encode_batch([" " + r["completion"] for r in chunk])
        for r, c, y in zip(chunk, ctx, comp):
            enc = {"context": c + eos, "completion": y + eos}
            if "cate" in r:
                enc["cate"] = r["cate"]
            out.append(enc)
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return out
