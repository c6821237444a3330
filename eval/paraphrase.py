"""A per-run subset of METEOR 1.5's English paraphrase table, so METEOR starts fast.

Loading the full table (5.3 M entries, ``paraphrase-en.gz`` of ``pycocoevalcap``)
takes METEOR 6-10 s of every run. METEOR ships ``FilterParaphrase``, which keeps
only the entries one of whose phrases occurs in the (normalised) references,
and documents that scores do not change (a paraphrase can only match where its
phrases occur). We keep a superset of what it keeps, without reading the whole
table on every run:

- once, the table is indexed into a cache folder (``$LORA_EVAL_CACHE`` or
  ``~/.cache/lora-eval``, about 420 MB): the decompressed table, the byte offset
  of every entry and the word ids of both its phrases; about 20-60 s, then reused;
- per run, ``V`` = for every lower-cased input token (and its form after
  METEOR's quote and dash normalisation), its single characters and every run of
  consecutive pieces, a piece being a maximal run of the normaliser's word
  characters or one other character: the normaliser (``-norm``) only splits
  tokens between such pieces and rewrites those characters, so every word it
  produces is in ``V``; an entry is kept if all words of either phrase are in
  ``V`` and, for phrases of several words, every two consecutive words could be
  adjacent in the normalised text; kept entries are copied byte for byte, in
  table order.

:func:`subset_table` returns None (use the full table) if the cache cannot be
built or written; set ``LORA_EVAL_FULL_PARAPHRASE=1`` to always use the full table.
"""

from __future__ import annotations

import gzip
import mmap
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

import numpy as np

__all__ = ["subset_table", "build_index", "ensure_index", "index_path"]

_VERSION = 2
_QUOTES = str.maketrans({"`": "'", "‘": "'", "’": "'", "“": '"', "”": '"', "–": "-"})
# METEOR Normalizer's ``alnum`` class (edu.cmu.meteor.util.Normalizer)
_WORD_CHARS = "0-9A-Za-zŠŽšžŸÀ-ÖØ-öø-žЀ-ӿԀ-ԧꙀ-ꙮ꙾-ꚗᴀ-ᵿ"
_PIECE = re.compile(f"[{_WORD_CHARS}]+|.", re.S)
_PIECE_WORD = re.compile(f"[{_WORD_CHARS}]")
_TOKENS: dict = {}  # token -> _Token, shared across runs of one process


def index_path(table: Path) -> Path:
    """Cache folder for ``table`` (keyed by its size and modification time)."""
    root = Path(os.environ.get("LORA_EVAL_CACHE") or Path.home() / ".cache" / "lora-eval")
    st = table.stat()
    return root / f"paraphrase-en.v{_VERSION}.{st.st_size}.{st.st_mtime_ns}"


def build_index(table: Path, out: Path) -> None:
    """Index the gzipped METEOR paraphrase table (``prob / phrase1 / phrase2`` lines) into ``out``.

    Files: ``table.txt`` (the table, decompressed), ``entry_off.npy`` (byte offset of
    every entry, plus the end), ``ids.npy`` (word ids of all phrases, phrase 1 and 2
    of each entry in turn), ``side_len.npy`` / ``side_start.npy`` (their word
    counts and first positions in ``ids``) and ``vocab.txt``.
    """
    raw = gzip.decompress(table.read_bytes())
    ends = np.flatnonzero(np.frombuffer(raw, dtype=np.uint8) == 10)  # byte offsets of the newlines
    if len(ends) % 3 or (len(raw) and ends[-1] != len(raw) - 1):
        raise ValueError(f"{table}: not a whole number of 3-line entries")
    entry_off = np.concatenate(([0], ends[2::3] + 1)).astype(np.int64)
    tmp = Path(tempfile.mkdtemp(dir=_mkdir(out.parent), prefix=out.name + ".tmp"))
    try:
        (tmp / "table.txt").write_bytes(raw)
        lines = raw.decode("utf-8").split("\n")
        del raw
        sides = [x for pair in zip(lines[1::3], lines[2::3], strict=True) for x in pair]
        del lines
        side_len = np.fromiter((x.count(" ") + 1 for x in sides), dtype=np.uint8, count=len(sides))
        vocab: dict[str, int] = {}
        parts = []
        for k in range(0, len(sides), 1 << 20):  # in chunks, to bound the memory
            tokens = " ".join(sides[k : k + (1 << 20)]).split(" ")
            parts.append(np.fromiter((vocab.setdefault(w, len(vocab)) for w in tokens), dtype=np.int64))
        ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if len(ids) != int(side_len.sum(dtype=np.int64)):
            raise ValueError(f"{table}: phrases are not single-space separated")
        if len(vocab) >= 2**16:
            raise ValueError(f"{table}: {len(vocab)} distinct words, more than this index holds")
        side_start = np.concatenate(([0], np.cumsum(side_len[:-1], dtype=np.int64))).astype(np.int32)
        (tmp / "vocab.txt").write_text("\n".join(vocab), encoding="utf-8")
        for name, arr in (
            ("entry_off", entry_off),
            ("ids", ids.astype(np.uint16)),
            ("side_len", side_len),
            ("side_start", side_start),
        ):
            np.save(tmp / f"{name}.npy", arr)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


class _Index:
    def __init__(self, path: Path):
        self.ids = np.load(path / "ids.npy", mmap_mode="r")
        self.lengths = np.load(path / "side_len.npy", mmap_mode="r")
        self.starts = np.load(path / "side_start.npy", mmap_mode="r")
        self.entry_off = np.load(path / "entry_off.npy", mmap_mode="r")
        with open(path / "table.txt", "rb") as fh:
            self.table = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.vocab = (path / "vocab.txt").read_text(encoding="utf-8").split("\n")
        # words without a letter or digit (a few odd symbols) are always kept
        self.always = np.array([not any(c.isalnum() for c in w) for w in self.vocab])
        self.word_id = {w: i for i, w in enumerate(self.vocab)}


@lru_cache(maxsize=1)
def _index(table: str) -> _Index | None:
    path = index_path(Path(table))
    if not path.exists():
        ensure_index(Path(table))
    return _Index(path) if path.exists() else None


def ensure_index(table: Path) -> Path | None:
    """Build the cache for ``table`` unless it exists; its folder, or None if impossible."""
    path = index_path(table)
    if path.exists():
        return path
    print(f"lora-eval: indexing METEOR's paraphrase table once into {path} (about 30 s) ...", file=sys.stderr)
    try:
        build_index(table, path)
    except (OSError, ValueError, MemoryError) as exc:
        if not path.exists():  # (another process may have just built it)
            print(f"lora-eval: cannot index the paraphrase table ({exc}); using the full table", file=sys.stderr)
            return None
    for old in path.parent.glob("paraphrase-en.v*"):  # earlier versions, stale temporaries
        if old != path and not old.name.startswith(path.name + ".tmp"):
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    return path


class _Token:
    """What ``-norm`` could make of one input token (its lower-cased forms)."""

    __slots__ = ("words", "heads", "tails", "pairs", "has_word")

    def __init__(self, token: str):
        low = token.lower()
        self.words: set = set()
        self.heads: set = set()  # words that can come first (after droppable pieces)
        self.tails: set = set()  # words that can come last
        self.pairs: set = set()  # words that can be adjacent inside the token
        self.has_word = False
        for form in {low, token.casefold(), low.translate(_QUOTES)}:
            self._add(form)

    def _add(self, form: str) -> None:
        pieces = _PIECE.findall(form)
        word = [bool(_PIECE_WORD.match(p)) for p in pieces]
        self.has_word |= any(word)
        n = len(pieces)
        spans = {(i, j): "".join(pieces[i:j]) for i in range(n) for j in range(i + 1, n + 1)}
        self.words.update(spans.values())
        lead = next((i for i in range(n) if word[i]), n)  # pieces before `lead` may vanish
        trail = max((j for j in range(n + 1) if not any(word[j:])), default=n)
        for (i, j), w in spans.items():
            if i <= lead:
                self.heads.add(w)
            if j >= trail:
                self.tails.add(w)
            k = j
            while True:  # following words, skipping non-word pieces between
                self.pairs.update((w, spans[(k, m)]) for m in range(k + 1, n + 1))
                if k >= n or word[k]:
                    break
                k += 1


def _text_words(text: str, words: set, pairs: set) -> None:
    """Add the words ``-norm`` could make of ``text`` and the pairs that could be adjacent."""
    carry: set = set()  # tails of the previous tokens that may precede the next word
    if len(_TOKENS) > 1_000_000:  # bound the memory of a long-lived process
        _TOKENS.clear()
    for token in text.split():
        tok = _TOKENS.get(token)
        if tok is None:
            tok = _TOKENS[token] = _Token(token)
        words |= tok.words
        pairs |= tok.pairs
        pairs.update((a, b) for a in carry for b in tok.heads)
        carry = (carry | tok.tails) if not tok.has_word else set(tok.tails)


def _write(idx: _Index, keep: np.ndarray, out: Path) -> None:
    """The kept entries, byte for byte as in the table, gzip-compressed (METEOR reads gzip)."""
    off = np.asarray(idx.entry_off)
    starts, ends = off[keep].tolist(), off[keep + 1].tolist()
    buf = idx.table
    data = b"".join([buf[s:e] for s, e in zip(starts, ends, strict=True)])
    with open(out, "wb") as fh:
        fh.write(gzip.compress(data, compresslevel=1))


def _check_adjacency(idx: _Index, side_ok: np.ndarray, pairs: set) -> None:
    """Clear ``side_ok`` for phrases with two consecutive words that cannot be adjacent."""
    wid = idx.word_id
    codes = [wid[a] * 65536 + wid[b] for a, b in pairs if a in wid and b in wid]
    allowed = np.unique(np.array(codes, dtype=np.int64))
    cand = np.flatnonzero(side_ok & (idx.lengths >= 2))
    if len(cand) == 0:
        return
    npairs = idx.lengths[cand].astype(np.int64) - 1
    first = np.cumsum(npairs) - npairs
    pos = np.repeat(idx.starts[cand] - first, npairs) + np.arange(int(npairs.sum()))
    left, right = idx.ids[pos], idx.ids[pos + 1]
    code = left.astype(np.int64) * 65536 + right
    at = np.minimum(np.searchsorted(allowed, code), max(len(allowed) - 1, 0))
    ok = (allowed[at] == code) if len(allowed) else np.zeros(len(code), dtype=bool)
    ok |= idx.always[left] | idx.always[right]
    side_ok[cand] = np.logical_and.reduceat(ok, first)


def subset_table(table: Path, texts: Iterable[str], out: Path) -> int | None:
    """Write the entries of ``table`` that the texts could use to ``out`` (gzip).

    Args:
        table: METEOR's ``paraphrase-en.gz``.
        texts: every hypothesis and reference METEOR will see.
        out: where to write the subset.

    Returns:
        The number of entries written, or None when the full table must be used.
    """
    if os.environ.get("LORA_EVAL_FULL_PARAPHRASE"):
        return None
    idx = _index(str(table))
    if idx is None:
        return None
    words: set = set()
    pairs: set = set()
    for text in texts:
        _text_words(text, words, pairs)
    known = np.fromiter((w in words for w in idx.vocab), dtype=bool, count=len(idx.vocab)) | idx.always
    side_ok = np.logical_and.reduceat(known[idx.ids], idx.starts)
    _check_adjacency(idx, side_ok, pairs)
    keep = np.flatnonzero(side_ok[0::2] | side_ok[1::2])
    if len(keep) == 0:
        keep = np.array([0])  # METEOR needs a non-empty table; one unused entry
    _write(idx, keep, out)
    return len(keep)
