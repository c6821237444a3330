"""Data layer of the NLG experiments: strict JSONL I/O, atomic writes, reference grouping
(the raw-source converters are in ``lora_core.data.convert``).

Framework-agnostic (plain Python; imports neither torch nor jittor). Nothing malformed is
skipped or half-read: :class:`DataFormatError` names the file, the 1-based line number and
the reason. ``allow_empty=True`` keeps empty completions, which real data has: DART
v1.1.1's test set holds one empty annotation (``test_formatted.jsonl`` line 117).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "check_outputs_apart",
    "DataFormatError",
    "ReferenceGroup",
    "check_data_file",
    "iter_lines",
    "read_jsonl",
    "read_formatted",
    "read_encoded",
    "write_jsonl_atomic",
    "write_text_atomic",
    "group_references",
]


class DataFormatError(ValueError):
    """Malformed input data; the message names the file, the 1-based line and the reason.

    Attributes:
        path: the offending file (or a description such as ``"<records>"``).
        line: 1-based line number, or None when no line applies.
        reason: what is wrong.
    """

    def __init__(self, path: str | os.PathLike, line: int | None, reason: str):
        self.path = str(path)
        self.line = line
        self.reason = reason
        where = self.path if line is None else f"{self.path}, line {line}"
        super().__init__(f"{where}: {reason}")


# --------------------------------------------------------------------------- I/O


def iter_lines(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """Yield ``(1-based line number, text)``; split on ``\\n`` only, decode strictly."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataFormatError(path, lineno, f"not valid UTF-8 ({e.reason})") from None


def check_data_file(path: str | os.PathLike, option: str | None = None, hint: str = "") -> Path:
    """Refuse, before reading it, a data file that cannot hold examples: missing, a folder,
    empty, or holding only blank lines (the readers would return no example, or stop at an
    "empty line"). Any line-based format; reads no further than its first non-blank byte.

    Args:
        path: the file.
        option: the command-line option named in the message (``--train``), if any.
        hint: added to the message of a missing file, e.g. ``"run examples.cls.prepare first"``.

    Raises:
        DataFormatError: naming the option, the file and the problem.
    """
    path = Path(path)
    where = f"{option} {path}" if option else path
    if not path.exists():
        raise DataFormatError(where, None, "no such file" + (f" ({hint})" if hint else ""))
    if path.is_dir():
        raise DataFormatError(where, None, "a folder, not a file")
    with open(path, "rb") as f:
        if not f.read(1):
            raise DataFormatError(where, None, "the file is empty (no examples)")
        f.seek(0)
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return path
    raise DataFormatError(where, None, "the file holds only blank lines (no examples)")


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSONL file whose every line is one JSON object.

    Args:
        path: the file.

    Returns:
        The objects in file order.

    Raises:
        DataFormatError: on an empty line, broken JSON or a value that is not an object.
    """
    records = []
    for lineno, text in iter_lines(path):
        if not text.strip():
            raise DataFormatError(path, lineno, "empty line")
        try:
            obj = json.loads(text.rstrip("\r\n"))  # without the line break: a column on this line
        except json.JSONDecodeError as e:
            raise DataFormatError(path, lineno, f"broken JSON: {e.msg} at column {e.colno}") from None
        if not isinstance(obj, dict):
            raise DataFormatError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
        records.append(obj)
    return records


EMPTY_REASON = "empty completion (allow_empty=True, or --allow-empty, keeps it)"


def _check_formatted(path, lineno: int, rec: dict, allow_empty: bool) -> None:
    for key in ("context", "completion"):
        if key not in rec:
            raise DataFormatError(path, lineno, f"missing field {key!r}")
        if not isinstance(rec[key], str):
            raise DataFormatError(path, lineno, f"field {key!r} must be a string")
    if not rec["context"].strip():
        raise DataFormatError(path, lineno, "empty context")
    if not allow_empty and not rec["completion"].strip():
        raise DataFormatError(path, lineno, EMPTY_REASON)
    if "cate" in rec and not isinstance(rec["cate"], bool):
        raise DataFormatError(path, lineno, "field 'cate' must be true or false")


def read_formatted(path: str | os.PathLike, allow_empty: bool = False) -> list[dict]:
    """Read a formatted file (``{"context", "completion"[, "cate"]}`` per line), validated.

    Args:
        path: the file.
        allow_empty: keep empty completions instead of raising (DART's test set has one).

    Raises:
        DataFormatError: as :func:`read_jsonl`, or on a missing/empty/non-string field.
    """
    records = read_jsonl(path)
    for lineno, rec in enumerate(records, 1):
        _check_formatted(path, lineno, rec, allow_empty)
    return records


def read_encoded(path: str | os.PathLike) -> list[dict]:
    """Read an encoded file (``{"context": [ids], "completion": [ids][, "cate"]}`` per line).

    Raises:
        DataFormatError: as :func:`read_jsonl`, or when a field is missing, empty or
            not a list of non-negative integers.
    """
    records = read_jsonl(path)
    for lineno, rec in enumerate(records, 1):
        for key in ("context", "completion"):
            ids = rec.get(key)
            if ids is None:
                raise DataFormatError(path, lineno, f"missing field {key!r}")
            if not isinstance(ids, list) or not ids:
                raise DataFormatError(path, lineno, f"field {key!r} must be a non-empty list of token ids")
            if not all(type(i) is int and i >= 0 for i in ids):
                raise DataFormatError(path, lineno, f"field {key!r} holds a value that is not a token id")
    return records


def check_outputs_apart(outputs: Sequence[tuple[str, str | os.PathLike | None]],
                        inputs: Sequence[tuple[str, str | os.PathLike | None]]) -> None:
    """Refuse, before any work, an output (``(option, path)``; a folder output's files are its
    own) that is an input, is another output, or lies inside another output (``--pred-out``
    given the ``--beam`` file would replace the beams with the predictions; inside the
    ``--ref-out`` folder, a reference file). None entries are absent options. ValueError naming
    the options and the path."""
    outs = [(o, Path(p).resolve()) for o, p in outputs if p is not None]
    ins = [(o, Path(p).resolve()) for o, p in inputs if p is not None]
    for i, (opt, path) in enumerate(outs):
        for other, q in ins:
            if path == q:
                raise ValueError(f"{opt} {path}: is the {other} input: it would be overwritten; give another path")
        for other, q in outs[:i]:
            if path == q or path in q.parents or q in path.parents:
                raise ValueError(f"{opt} {path} and {other} {q}: the same file, or one inside the other: "
                                 f"give them apart")  # fmt: skip


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8, ``\n`` newlines) to ``path`` atomically (``checkpoint.atomic_write``)."""
    from ..formats.checkpoint import atomic_write

    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8", newline="\n"))


def jsonl_text(records: Iterable[dict]) -> str:
    """One ``json.dumps(record)`` per line, each ``\\n``-terminated: the text of a JSONL file.

    ``json.dumps`` defaults (ASCII escapes) match the paper's formatted files byte for byte.
    """
    return "".join(json.dumps(r) + "\n" for r in records)


def write_jsonl_atomic(path: str | os.PathLike, records: Iterable[dict]) -> None:
    """Write ``records`` as JSONL (:func:`jsonl_text`) atomically."""
    write_text_atomic(path, jsonl_text(records))


# --------------------------------------------------------------------------- grouping


@dataclass
class ReferenceGroup:
    """One unique input: its context (text or token ids), its references and WebNLG ``cate``."""

    context: str | list[int]
    references: list[Any] = field(default_factory=list)
    cate: bool | None = None


def group_references(records: Sequence[dict], source: str = "<records>") -> list[ReferenceGroup]:
    """Group records by context: unique contexts in first-appearance order.

    As gpt2_decode.py (a dict keyed by context), references of one context need not
    be consecutive. Works on formatted (str contexts) and encoded (id-list contexts)
    records. The beam search runs once per group, and decode writes one instance per
    group.

    Args:
        records: dicts with ``context`` and ``completion`` (and optional ``cate``).
        source: name used in error messages (e.g. the file the records came from).

    Raises:
        DataFormatError: when records of one context disagree on ``cate`` (the
            seen/unseen filter would then be ambiguous); line = record index + 1.
    """
    groups: dict[Any, ReferenceGroup] = {}
    for i, rec in enumerate(records):
        ctx = rec["context"]
        key = tuple(ctx) if isinstance(ctx, list) else ctx
        cate = rec.get("cate")
        g = groups.get(key)
        if g is None:
            g = groups[key] = ReferenceGroup(context=ctx, cate=cate)
        elif g.cate != cate:
            raise DataFormatError(
                source, i + 1, f"cate={cate} differs from cate={g.cate} of an earlier record with the same context"
            )
        g.references.append(rec["completion"])
    return list(groups.values())
