"""A per-run subset of METEOR 1.5's English paraphrase table, so METEOR starts fast.

Loading the full table (5.3 M entries, ``paraphrase-en.gz`` of ``pycocoevalcap``)
takes METEOR 6-10 s of every run. METEOR ships ``FilterParaphrase``, which keeps
only the entries one of whose phrases occurs in the (normalised) references,
and documents that scores do not change (a paraphrase can only match where its
phrases occur). Its ``ParaphraseMatcher`` in fact matches an entry only where
one phrase occurs in the hypothesis and the other in the reference, so given
the hypotheses too we keep a superset of those entries (about 10 k for the E2E
test set instead of 300 k), without reading the whole table on every run:

- once, the table is indexed into a cache folder (``$LORA_EVAL_CACHE`` or
  ``~/.cache/lora-eval``, about 460 MB): the decompressed table, the byte offset
  of every entry, the word ids of both its phrases and the phrases grouped by
  their rarest word; about 20-60 s, then reused;
- per run, ``V`` = for every lower-cased input token (and its form after
  METEOR's quote and dash normalisation), its single characters and every run of
  consecutive pieces, a piece being a maximal run of the normaliser's word
  characters or one other character: the normaliser (``-norm``) only splits
  tokens between such pieces and rewrites those characters, so every word it
  produces is in ``V``; a phrase could occur if all its words are in ``V`` and,
  for phrases of several words, every two consecutive words could be adjacent
  in the normalised text (``V`` and the adjacent pairs are computed for the
  references and the hypotheses separately); kept entries are copied byte for
  byte, in table order (the order of the matches that remain is unchanged).

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

__all__ = ["subset_table", "build_index", "ensure_index", "index_path", "index_ready"]

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


def index_ready(table: Path) -> bool:
    """Whether the cache for ``table`` is complete (a run will not have to build any of it)."""
    path = index_path(table)
    return path.is_dir() and all((path / name).exists() for name in _RARE_FILES)


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
        del ids
        _build_rare(tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_RARE_FILES = ("rare_sides.npy", "rare_off.npy")


def _build_rare(path: Path) -> None:
    """Add ``rare_sides.npy`` / ``rare_off.npy`` to the index in ``path``: the phrases
    grouped by their rarest word (the fewest occurrences in the table, then the
    smallest id); the phrases whose rarest word is ``w`` are
    ``rare_sides[rare_off[w]:rare_off[w + 1]]``, ascending. A phrase can only occur
    in a text if its rarest word can, so a run looks at those groups only."""
    ids = np.load(path / "ids.npy", mmap_mode="r")
    starts = np.load(path / "side_start.npy")
    nvocab = len((path / "vocab.txt").read_text(encoding="utf-8").split("\n"))
    key = np.bincount(ids, minlength=nvocab).astype(np.int64) * 65536 + np.arange(nvocab, dtype=np.int64)
    rarest = (np.minimum.reduceat(key[ids], starts) & 0xFFFF).astype(np.uint16) if len(starts) else key[:0]
    order = np.argsort(rarest, kind="stable").astype(np.int32)
    off = np.concatenate(([0], np.cumsum(np.bincount(rarest, minlength=nvocab)))).astype(np.int64)
    for name, arr in zip(_RARE_FILES, (order, off), strict=True):
        tmp = path / f".{name}.{os.getpid()}.tmp.npy"
        try:
            np.save(tmp, arr)
            os.replace(tmp, path / name)
        finally:
            tmp.unlink(missing_ok=True)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


class _Index:
    def __init__(self, path: Path):
        self.ids = np.load(path / "ids.npy", mmap_mode="r")
        self.lengths = np.load(path / "side_len.npy", mmap_mode="r")
        self.starts = np.load(path / "side_start.npy", mmap_mode="r")
        self.entry_off = np.load(path / "entry_off.npy", mmap_mode="r")
        self.rare_sides = np.load(path / "rare_sides.npy", mmap_mode="r")
        self.rare_off = np.load(path / "rare_off.npy")
        with open(path / "table.txt", "rb") as fh:
            self.table = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.vocab = (path / "vocab.txt").read_text(encoding="utf-8").split("\n")
        # words without a letter or digit (a few odd symbols) are always kept
        self.always = np.array([not any(c.isalnum() for c in w) for w in self.vocab])
        self.word_id = {w: i for i, w in enumerate(self.vocab)}


@lru_cache(maxsize=1)
def _index(table: str) -> _Index | None:
    path = ensure_index(Path(table))
    return _Index(path) if path is not None else None


def ensure_index(table: Path) -> Path | None:
    """Build the cache for ``table`` unless it exists; its folder, or None if impossible."""
    path = index_path(table)
    if path.exists():
        if all((path / name).exists() for name in _RARE_FILES):
            return path
        try:  # an index of an earlier release of this module: add the rarest-word groups
            _build_rare(path)
            return path
        except (OSError, ValueError, MemoryError) as exc:
            print(f"lora-eval: cannot extend the paraphrase index ({exc}); using the full table", file=sys.stderr)
            return None
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


def _text_vocab(texts: Iterable[str]) -> tuple[set, set]:
    """The words ``-norm`` could make of the texts and the pairs that could be adjacent
    (each distinct token, and each distinct token after the same context, looked at once)."""
    words: set = set()
    pairs: set = set()
    seen: set = set()  # tokens and (context, token) pairs already added
    if len(_TOKENS) > 1_000_000:  # bound the memory of a long-lived process
        _TOKENS.clear()
    for text in texts:
        carry: set = set()  # tails of the previous tokens that may precede the next word
        context = None  # what `carry` was made of
        for token in text.split():
            tok = _TOKENS.get(token)
            if tok is None:
                tok = _TOKENS[token] = _Token(token)
            if token not in seen:
                seen.add(token)
                words |= tok.words
                pairs |= tok.pairs
            if carry:
                key = (context, token)
                if key not in seen:
                    seen.add(key)
                    pairs.update((a, b) for a in carry for b in tok.heads)
            if tok.has_word:
                carry, context = tok.tails, token
            else:
                carry, context = carry | tok.tails, (context, token)
    return words, pairs


def _write(idx: _Index, keep: np.ndarray, out: Path) -> None:
    """The kept entries, byte for byte as in the table, gzip-compressed (METEOR reads gzip)."""
    off = np.asarray(idx.entry_off)
    starts, ends = off[keep].tolist(), off[keep + 1].tolist()
    buf = idx.table
    data = b"".join([buf[s:e] for s, e in zip(starts, ends, strict=True)])
    with open(out, "wb") as fh:
        fh.write(gzip.compress(data, compresslevel=1))


def _possible(idx: _Index, texts: Iterable[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(known, allowed)``: which vocabulary words ``-norm`` could make of the texts
    (words without a letter or digit always count), and the sorted codes
    ``id(a) * 65536 + id(b)`` of the word pairs that could be adjacent."""
    words, pairs = _text_vocab(texts)
    wid = idx.word_id
    known = np.zeros(len(idx.vocab), dtype=bool)
    known[[wid[w] for w in words if w in wid]] = True
    known |= idx.always
    codes = [wid[a] * 65536 + wid[b] for a, b in pairs if a in wid and b in wid]
    return known, np.unique(np.array(codes, dtype=np.int64))


def _sides_possible(idx: _Index, known: np.ndarray, allowed: np.ndarray, sides: np.ndarray | None = None) -> np.ndarray:
    """The phrases (of ``sides``, default all; ascending) that could occur in the texts.

    A phrase could occur if each of its words is ``known`` and each two consecutive
    words could be adjacent (``allowed``, or one of them is a word without a letter
    or digit). Without ``sides``, only the phrases whose rarest word is known are
    looked at; the first word is checked before the others.
    """
    if sides is None:  # the phrases whose rarest word is known
        w = np.flatnonzero(known)
        lo, n = idx.rare_off[w], idx.rare_off[w + 1] - idx.rare_off[w]
        sides = np.sort(idx.rare_sides[np.repeat(lo - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))])
    starts = np.asarray(idx.starts)[sides].astype(np.int64)
    npairs = np.asarray(idx.lengths)[sides].astype(np.int64) - 1
    ok = known[idx.ids[starts]]  # the first word
    for check in ("words", "pairs"):  # then the others, then their adjacency
        multi = np.flatnonzero(ok & (npairs > 0))
        if len(multi) == 0:
            break
        n = npairs[multi]
        off = np.cumsum(n) - n
        left = np.repeat(starts[multi] - off, n) + np.arange(int(n.sum()))  # all but the last word
        right = np.asarray(idx.ids[left + 1]).astype(np.int64)
        if check == "words":
            good = known[right]
        else:
            left = np.asarray(idx.ids[left]).astype(np.int64)
            code = left * 65536 + right
            at = np.minimum(np.searchsorted(allowed, code), max(len(allowed) - 1, 0))
            good = (allowed[at] == code) if len(allowed) else np.zeros(len(code), dtype=bool)
            good |= idx.always[left] | idx.always[right]
        ok[multi] = np.logical_and.reduceat(good, off)
    return sides[ok].astype(np.int64)


def subset_table(table: Path, texts: Iterable[str], out: Path, hyps: Iterable[str] | None = None) -> int | None:
    """Write the entries of ``table`` that the texts could use to ``out`` (gzip).

    Args:
        table: METEOR's ``paraphrase-en.gz``.
        texts: every reference METEOR will see (or every text, without ``hyps``).
        out: where to write the subset.
        hyps: every hypothesis METEOR will see. METEOR's ``ParaphraseMatcher``
            matches an entry only where one of its phrases occurs in the hypothesis
            and the other in the reference (and the matches of the other entries
            keep their order), so with ``hyps`` an entry is kept if one phrase could
            occur in the references and the other in the hypotheses; without, if
            either phrase could occur in ``texts`` (what ``FilterParaphrase`` does).

    Returns:
        The number of entries written, or None when the full table must be used.
    """
    if os.environ.get("LORA_EVAL_FULL_PARAPHRASE"):
        return None
    idx = _index(str(table))
    if idx is None:
        return None
    if hyps is None:
        keep = np.unique(_sides_possible(idx, *_possible(idx, texts)) >> 1)
    else:  # the hypothesis side first (fewer phrases pass), then the other phrase of each entry
        other = np.sort(_sides_possible(idx, *_possible(idx, hyps)) ^ 1)
        keep = np.unique(_sides_possible(idx, *_possible(idx, texts), sides=other) >> 1)
    if len(keep) == 0:
        keep = np.array([0])  # METEOR needs a non-empty table; one unused entry
    _write(idx, keep, out)
    return len(keep)
