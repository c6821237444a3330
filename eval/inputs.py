"""Reading the evaluator's input files, strictly.

One rule for every file: UTF-8, one instance per line, a final newline ends the
last line (it is not an extra, empty instance), an empty line inside the file is
an empty instance, and a trailing ``\\r`` (CRLF files) is dropped. Anything that
would make the official scorers silently shift or truncate instances (counts that
disagree, reference files of different lengths, undecodable bytes, a missing
file) raises :class:`EvalInputError` naming the file, both counts and the first
offending line.

E2E reference files follow ``measure_scores.py`` (tuetschek/e2e-metrics): every
line is stripped, the references of one instance are consecutive lines and
instances are separated by one empty line; a file with no empty line holds one
reference per instance.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "EvalInputError",
    "JavaUnavailableError",
    "read_lines",
    "read_bytes_checked",
    "group_e2e_references",
    "read_e2e_references",
    "transpose_references",
    "count_mismatch",
    "preview",
    "chopped_raw_lines",
]

PathLike = str | os.PathLike


class EvalInputError(ValueError):
    """Input files that cannot be scored without mis-aligning instances."""


class JavaUnavailableError(RuntimeError):
    """A metric needs the Java runtime (METEOR 1.5, the CoreNLP PTB tokenizer)."""


def _preview(line: str, width: int = 80) -> str:
    return repr(line if len(line) <= width else line[:width] + "...")


def read_bytes_checked(path: PathLike) -> bytes:
    """The bytes of ``path``; EvalInputError if it is missing or not a file."""
    p = Path(path)
    if not p.exists():
        raise EvalInputError(f"{p}: file not found")
    if not p.is_file():
        raise EvalInputError(f"{p}: not a regular file")
    return p.read_bytes()


def _decode(path: PathLike, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_no = data.count(b"\n", 0, exc.start) + 1
        line_start = data.rfind(b"\n", 0, exc.start) + 1
        line_end = data.find(b"\n", exc.start)
        raw = data[line_start : line_end if line_end >= 0 else len(data)]
        raise EvalInputError(
            f"{path}: line {line_no} is not valid UTF-8 ({exc.reason}: byte "
            f"0x{data[exc.start]:02x} at column {exc.start - line_start + 1}): "
            f"{_preview(raw.decode('utf-8', 'replace'))}"
        ) from None


def split_text_lines(text: str) -> list[str]:
    """Lines of ``text``: a final newline ends the last line; ``\\r\\n`` counts as ``\\n``."""
    if not text:
        return []
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_lines(path: PathLike) -> list[str]:
    """The lines of a UTF-8 text file (see the module docstring for the rules).

    Args:
        path: file to read.

    Returns:
        One string per line, without line terminators (not stripped).
    """
    return split_text_lines(_decode(path, read_bytes_checked(path)))


def chopped_raw_lines(data: bytes) -> list[str]:
    """Lines as ``multi-bleu-detok.perl`` sees them: Perl ``chop`` on each line.

    ``chop`` drops the newline of every line, and the last byte of a last line
    that has no newline (so a file without a final newline loses its last
    character there). Bytes are decoded with ``surrogateescape`` so that a byte
    cut out of a multi-byte character stays one unmatched word character, as in
    Perl's byte mode. A ``\\r`` before the newline stays (it is whitespace there).
    """
    if not data:
        return []
    parts = data.split(b"\n")
    if data.endswith(b"\n"):
        parts.pop()
    else:
        parts[-1] = parts[-1][:-1]
    return [p.decode("utf-8", "surrogateescape") for p in parts]


def group_e2e_references(lines: Sequence[str]) -> tuple[list[list[str]], list[int]]:
    """``measure_scores.py`` multi-reference grouping of (already stripped) lines.

    Args:
        lines: stripped lines of the reference file.

    Returns:
        ``(groups, starts)``: the references of each instance (groups separated by
        one empty line, a trailing empty group dropped; without any empty line, one
        reference per line) and the 1-based line on which each group starts.
    """
    groups: list[list[str]] = [[]]
    starts = [1]
    for no, line in enumerate(lines, start=1):
        if line:
            groups[-1].append(line)
        else:
            groups.append([])
            starts.append(no + 1)
    if not groups[-1]:
        groups.pop()
        starts.pop()
    if len(groups) == 1:
        return [[ref] for ref in groups[0]], list(range(1, len(groups[0]) + 1))
    return groups, starts


def read_e2e_references(path: PathLike) -> tuple[list[list[str]], list[int]]:
    """E2E reference file -> (references per instance, first line of each instance).

    An instance without any reference (two empty lines in a row) is an error: the
    official scorer would crash or score it against nothing.
    """
    groups, starts = group_e2e_references([line.strip() for line in read_lines(path)])
    for i, refs in enumerate(groups):
        if not refs:
            raise EvalInputError(
                f"{path}: instance {i + 1} (line {starts[i]}) has no reference: two empty "
                f"lines in a row; separate instances by exactly one empty line"
            )
    return groups, starts


def count_mismatch(
    hyp_path: PathLike, n_hyp: int, ref_path: PathLike, n_ref: int, unit: str, first_extra: str
) -> EvalInputError:
    """The error for hypothesis and reference instance counts that disagree.

    Args:
        hyp_path, n_hyp: hypothesis file and its number of lines.
        ref_path, n_ref: reference file and its number of instances.
        unit: how ``ref_path`` counts instances, e.g. ``"reference groups"``.
        first_extra: the first instance that has no partner, quoted by the caller.
    """
    return EvalInputError(
        f"count mismatch: {hyp_path} has {n_hyp} hypotheses (lines) but {ref_path} has "
        f"{n_ref} {unit}; first without a partner: {first_extra}"
    )


def preview(line: str, width: int = 80) -> str:
    """A short quoted form of ``line`` for error messages."""
    return _preview(line, width)


def transpose_references(paths: Sequence[PathLike], columns: Sequence[Sequence[str]]) -> list[list[str]]:
    """Reference files (one column each) -> references per instance; lengths must agree.

    Args:
        paths: the reference files, for messages.
        columns: the lines of each file.

    Returns:
        ``refs[i]`` = the i-th line of every file, in file order.
    """
    n0 = len(columns[0])
    for path, col in zip(paths[1:], columns[1:], strict=True):
        if len(col) != n0:
            first = min(n0, len(col))
            longer_path, longer = (paths[0], columns[0]) if n0 > len(col) else (path, col)
            raise EvalInputError(
                f"reference files differ in length: {paths[0]} has {n0} lines but {path} has "
                f"{len(col)}; first unmatched line: {longer_path} line {first + 1}: "
                f"{_preview(longer[first])}"
            )
    return [list(refs) for refs in zip(*columns, strict=True)]
