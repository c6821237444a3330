"""Reading the evaluator's input files, strictly.

One rule for every file: UTF-8, one instance per line, a final newline ends the
last line (it is not an extra, empty instance), an empty line inside the file is
an empty instance, and a trailing ``\\r`` (CRLF files) is dropped. Anything that
would make the official scorers silently shift or truncate instances (counts that
disagree, reference files of different lengths, undecodable bytes, a missing
file) raises :class:`EvalInputError` naming the file, both counts and the first
offending line.

WebNLG/DART reference files of different lengths are accepted exactly where
GenerationEval's ``eval.py`` aligns them: it reads every file with
``read().split('\\n')``, so a file that alone ends with a newline and has one line
fewer than the others gives the last instance an empty reference (DART's own
``all-delex-reference{0,1,2}.lex``); see :func:`align_reference_files`.

The official scorers read some files again with Python's line splitting
(``codecs`` readers, :meth:`str.splitlines`), which also breaks lines at a lone
``\\r``, VT, FF, FS, GS, RS, NEL, U+2028 and U+2029; :func:`codecs_line_break`
finds those, so that the scorers can refuse what the official ones would split.

E2E reference files follow ``measure_scores.py`` (tuetschek/e2e-metrics): every
line is stripped, the references of one instance are consecutive lines and
instances are separated by one empty line; a file with no empty line holds one
reference per instance.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "EvalInputError",
    "JavaUnavailableError",
    "read_lines",
    "LineFile",
    "read_line_file",
    "align_reference_files",
    "codecs_line_break",
    "refuse_codecs_breaks",
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


@dataclass(frozen=True)
class LineFile:
    """A text file split into lines, with what GenerationEval's ``eval.py`` makes of it.

    Attributes:
        path: the file.
        lines: its lines without the ``\\n`` (a final newline ends the last line and adds
            none); the ``\\r`` of a CRLF line end is kept, as ``eval.py`` keeps it.
        entries: ``len(read().split('\\n'))``, the lines ``eval.py`` reads: one more than
            ``lines`` when the file ends with a newline (or is empty).
    """

    path: PathLike
    lines: list[str]
    entries: int


def read_line_file(path: PathLike) -> LineFile:
    """The :class:`LineFile` of a UTF-8 text file (EvalInputError: missing, undecodable)."""
    text = _decode(path, read_bytes_checked(path))
    lines = text.split("\n")
    entries = len(lines)
    if text.endswith("\n") or not text:
        lines.pop()
    return LineFile(path, lines, entries)


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


# Python's line splitting (codecs readers, str.splitlines) breaks lines at these too;
# "\r" only where no "\n" follows (a CRLF line end is one break).
_CODECS_BREAK = re.compile("\r(?!\n)|[\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")
_BREAK_NAMES = {"\r": "CR", "\x0b": "VT", "\x0c": "FF", "\x1c": "FS", "\x1d": "GS", "\x1e": "RS", "\x85": "NEL"}


def codecs_line_break(text: str) -> str | None:
    """The first character of ``text`` at which Python's ``codecs`` line reading (as in
    ``measure_scores.py`` and GenerationEval's chrF++) would end a line, described as
    e.g. ``"U+2028 (column 7)"``; None if there is none besides ``\\n`` and CRLF."""
    m = _CODECS_BREAK.search(text)
    if m is None:
        return None
    ch = m.group()[0]
    name = _BREAK_NAMES.get(ch, "LINE SEPARATOR" if ch == "\u2028" else "PARAGRAPH SEPARATOR")
    return f"U+{ord(ch):04X} {name} (column {m.start() + 1})"


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


def refuse_codecs_breaks(path: PathLike, lines: Sequence[str], reader: str) -> None:
    """EvalInputError naming the first line that ``reader`` (an official scorer reading
    the file with Python's ``codecs`` line splitting) would split in two.

    Args:
        path: the file, for the message.
        lines: its lines (:func:`read_lines`: the CR of a CRLF line end removed).
        reader: who reads it that way, e.g. ``"measure_scores.py"``.
    """
    for no, line in enumerate(lines, start=1):
        found = codecs_line_break(line)
        if found is not None:
            raise EvalInputError(
                f"{path}: line {no} contains {found}, where {reader}'s codecs line reading ends a "
                f"line: the official scorer would read one line more here and mis-align the "
                f"instances that follow; remove the character: {_preview(line)}"
            )


def read_e2e_references(path: PathLike) -> tuple[list[list[str]], list[int]]:
    """E2E reference file -> (references per instance, first line of each instance).

    An instance without any reference (two empty lines in a row, or an empty first line) is
    an error: the official scorer would crash or score it against nothing; so is a line that
    the official reading splits in two (:func:`refuse_codecs_breaks`).
    """
    lines = read_lines(path)
    refuse_codecs_breaks(path, lines, "measure_scores.py")
    groups, starts = group_e2e_references([line.strip() for line in lines])
    for i, refs in enumerate(groups):
        if not refs and i == 0:  # the first group is empty only when line 1 is
            raise EvalInputError(
                f"{path}: instance 1 (line 1) has no reference: the file starts with an empty "
                f"line; remove it (instances are separated by exactly one empty line)"
            )
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
    files = [LineFile(p, list(c), len(c)) for p, c in zip(paths, columns, strict=True)]
    return align_reference_files(files)  # equal entry counts: no file is padded


def align_reference_files(files: Sequence[LineFile]) -> list[list[str | None]]:
    """References per instance of WebNLG/DART reference files, aligned as ``eval.py`` aligns them.

    Files with the same number of lines are aligned line by line (a final newline is not
    an instance, whichever files have one). Files of different lengths are accepted only
    where GenerationEval's ``eval.py`` (``read().split('\\n')`` of each file) aligns them:
    every file then gives it the same number of entries, so a file one line shorter than
    the others ends with a newline that they lack, and its entry for the last instance is
    the empty string after that newline. That reference is ``None`` here: empty for METEOR,
    TER and chrF++, and absent for ``multi-bleu-detok.perl``, which reads one line fewer
    from that file. Anything else would be mis-aligned (or crash ``eval.py``) and raises.

    Args:
        files: the reference files (:func:`read_line_file`), in order.

    Returns:
        ``refs[i][k]``: line i of file k, or None (the last instance of a short file).

    Raises:
        EvalInputError: no file, or lengths that ``eval.py`` does not align, naming the
            longest and the first short file, their counts and the first unmatched line.
    """
    if not files:
        raise EvalInputError("no reference file given")
    counts = [len(f.lines) for f in files]
    n = max(counts)
    if min(counts) != n and len({f.entries for f in files}) != 1:
        longest = files[counts.index(n)]
        short = next(f for f in files if len(f.lines) != n)
        first = len(short.lines)
        raise EvalInputError(
            f"reference files differ in length: {longest.path} has {n} lines but {short.path} has "
            f"{first}; first unmatched line: {longest.path} line {first + 1}: {_preview(longest.lines[first])} "
            f"(eval.py's read().split('\\n') gives {longest.entries} and {short.entries} entries; a file may "
            f"be one line short only when it alone ends with a newline, which eval.py reads as an empty "
            f"last reference)"
        )
    return [[f.lines[i] if i < len(f.lines) else None for f in files] for i in range(n)]
