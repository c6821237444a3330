"""Raw-source converters of the NLG experiments (plain Python; no torch, no jittor).

They reproduce the LoRA paper code (Hu et al. 2021, microsoft/LoRA
``examples/NLG/src/format_converting_{e2e,webnlg,dart}.py``): every source becomes
records ``{"context": str, "completion": str}`` (WebNLG adds ``"cate": bool``, true
for the ten categories seen in training), one record per reference text, in file
order. Serialised with ``json.dumps`` defaults, our output is byte-identical to the
paper's formatted files.

Unlike the paper scripts, nothing malformed is skipped or half-read: a line without
``||``, broken JSON, a missing field or an empty completion raises
:class:`lora_core.data.nlg.DataFormatError` naming the file, the 1-based line number and the
reason. ``allow_empty=True`` keeps empty completions, which real data has: DART v1.1.1's
test set holds one empty annotation (``test_formatted.jsonl`` line 117).
The one documented filter is WebNLG's: only lexicalisations whose ``comment`` is
``"good"`` are kept, as in the paper.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

from .nlg import EMPTY_REASON, DataFormatError, iter_lines, read_formatted

__all__ = ["WEBNLG_SEEN_CATEGORIES", "CONVERTERS", "convert", "convert_e2e", "convert_webnlg", "convert_dart"]

# format_converting_webnlg.py: the WebNLG 2017 categories present in the training set.
WEBNLG_SEEN_CATEGORIES = (
    "Airport",
    "Astronaut",
    "Building",
    "City",
    "ComicsCharacter",
    "Food",
    "Monument",
    "SportsTeam",
    "University",
    "WrittenWork",
)


# --------------------------------------------------------------------------- converters


def convert_e2e(path: str | os.PathLike, allow_empty: bool = False) -> list[dict]:
    """Convert E2E ``MR||text`` lines (format_converting_e2e.py).

    As the paper: the line is stripped, then split at ``||``; context is the part
    before (kept verbatim), completion the part after.

    Args:
        path: the file.
        allow_empty: keep an empty text instead of raising.

    Raises:
        DataFormatError: on an empty line, no ``||``, more than one ``||``, an
            empty MR, or an empty text (unless ``allow_empty``).
    """
    records = []
    for lineno, text in iter_lines(path):
        line = text.strip()
        if not line:
            raise DataFormatError(path, lineno, "empty line")
        parts = line.split("||")
        if len(parts) == 1:
            raise DataFormatError(path, lineno, "no '||' between MR and text")
        if len(parts) > 2:
            raise DataFormatError(path, lineno, f"{len(parts) - 1} '||' separators, expected 1")
        context, completion = parts
        if not context.strip():
            raise DataFormatError(path, lineno, "empty MR")
        if not allow_empty and not completion.strip():
            raise DataFormatError(path, lineno, EMPTY_REASON)
        records.append({"context": context, "completion": completion})
    return records


def _line_counter(text: str) -> Callable[[int], int]:
    """Return ``offset -> 1-based line``; offsets must not decrease between calls."""
    state = [0, 1]  # last offset, its line

    def line_at(offset: int) -> int:
        state[1] += text.count("\n", state[0], offset)
        state[0] = offset
        return state[1]

    return line_at


_WS = " \t\n\r"


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _iter_json_array(path, text: str, i: int, line_at) -> Iterator[tuple[int, Any]]:
    """Yield ``(line, item)`` for the JSON array starting at ``text[i] == '['``."""
    dec = json.JSONDecoder()
    i = _skip_ws(text, i + 1)
    if i < len(text) and text[i] == "]":
        return
    while True:
        try:
            item, end = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise DataFormatError(path, e.lineno, f"broken JSON: {e.msg} at column {e.colno}") from None
        yield line_at(i), item
        i = _skip_ws(text, end)
        if i < len(text) and text[i] == ",":
            i = _skip_ws(text, i + 1)
        elif i < len(text) and text[i] == "]":
            return
        else:
            raise DataFormatError(path, line_at(min(i, len(text))), "broken JSON: expected ',' or ']'")


def _load_json(path) -> tuple[str, Any]:
    text = "".join(t for _, t in iter_lines(path))
    try:
        return text, json.loads(text)
    except json.JSONDecodeError as e:
        raise DataFormatError(path, e.lineno, f"broken JSON: {e.msg} at column {e.colno}") from None


def _iter_entries(path, text: str, top: Any, key: str | None) -> Iterator[tuple[int, Any]]:
    """Yield ``(line, item)`` of the top-level array (``key=None``) or of ``top[key]``."""
    line_at = _line_counter(text)
    dec = json.JSONDecoder()
    i = _skip_ws(text, 0)
    if key is None:
        if not isinstance(top, list):
            raise DataFormatError(path, 1, "expected a JSON array of examples")
        yield from _iter_json_array(path, text, i, line_at)
        return
    if not isinstance(top, dict) or not isinstance(top.get(key), list):
        raise DataFormatError(path, 1, f"expected a JSON object with a list {key!r}")
    i = _skip_ws(text, i + 1)  # past '{'; the document is valid JSON, so walk its keys
    while True:
        name, i = dec.raw_decode(text, i)
        i = _skip_ws(text, _skip_ws(text, i) + 1)  # past ':'
        if name == key:
            yield from _iter_json_array(path, text, i, line_at)
            return
        _, i = dec.raw_decode(text, i)
        i = _skip_ws(text, _skip_ws(text, i) + 1)  # past ','


def _field(path, line: int, obj: Any, key: str, kind: type, where: str):
    if not isinstance(obj, dict) or key not in obj:
        raise DataFormatError(path, line, f"{where}: missing field {key!r}")
    if not isinstance(obj[key], kind):
        raise DataFormatError(path, line, f"{where}: field {key!r} must be a {kind.__name__}")
    return obj[key]


def convert_webnlg(path: str | os.PathLike, allow_empty: bool = False) -> list[dict]:
    """Convert WebNLG 2017 JSON (``{"entries": [{"<k>": entry}, ...]}``; format_converting_webnlg.py).

    Context: the ``modifiedtripleset`` as ``"subj : prop : obj"`` joined by ``" | "``.
    One record per lexicalisation whose ``comment`` is ``"good"`` (the paper's filter;
    other lexicalisations, e.g. ``"toFix"``, are dropped by design, so an entry with no
    ``good`` one yields nothing; WebNLG 2017 dev has 10 such). ``cate`` is True when the entry's
    category is in :data:`WEBNLG_SEEN_CATEGORIES`. Line numbers in errors point at the
    start of the offending entry.

    Args:
        path: the file.
        allow_empty: keep an empty ``lex`` instead of raising.

    Raises:
        DataFormatError: on broken JSON, a missing field, an entry with no triple,
            or an empty ``good`` ``lex`` (unless ``allow_empty``).
    """
    text, top = _load_json(path)
    records = []
    for k, (line, wrapper) in enumerate(_iter_entries(path, text, top, "entries"), 1):
        where = f"entry {k}"
        entry = _field(path, line, wrapper, str(k), dict, where)
        category = _field(path, line, entry, "category", str, where)
        triples = _field(path, line, entry, "modifiedtripleset", list, where)
        lexes = _field(path, line, entry, "lexicalisations", list, where)
        if not triples:
            raise DataFormatError(path, line, f"{where}: empty modifiedtripleset")
        parts = []
        for t, triple in enumerate(triples, 1):
            s, p, o = (
                _field(path, line, triple, f, str, f"{where}, triple {t}") for f in ("subject", "property", "object")
            )
            parts.append(f"{s} : {p} : {o}")
        context = " | ".join(parts)
        for j, lex in enumerate(lexes, 1):
            w = f"{where}, lexicalisation {j}"
            if _field(path, line, lex, "comment", str, w) != "good":
                continue
            completion = _field(path, line, lex, "lex", str, w)
            if not allow_empty and not completion.strip():
                raise DataFormatError(path, line, f"{w}: {EMPTY_REASON}")
            records.append({"context": context, "completion": completion, "cate": category in WEBNLG_SEEN_CATEGORIES})
    return records


def convert_dart(path: str | os.PathLike, allow_empty: bool = False) -> list[dict]:
    """Convert DART JSON (a list of ``{"tripleset", "annotations"}``; format_converting_dart.py).

    Context: triples ``[subj, rel, obj]`` as ``"subj : rel.lower() : obj"`` joined by
    ``" | "`` (relations lower-cased as in the paper). One record per annotation ``text``.

    Args:
        path: the file.
        allow_empty: keep an empty ``text`` instead of raising (the v1.1.1 test set
            has one).

    Raises:
        DataFormatError: on broken JSON, a missing field, a triple that is not three
            strings, an example with no triple or no annotation, or an empty ``text``
            (unless ``allow_empty``).
    """
    text, top = _load_json(path)
    records = []
    for k, (line, ex) in enumerate(_iter_entries(path, text, top, None), 1):
        where = f"example {k}"
        triples = _field(path, line, ex, "tripleset", list, where)
        annotations = _field(path, line, ex, "annotations", list, where)
        if not triples:
            raise DataFormatError(path, line, f"{where}: empty tripleset")
        if not annotations:
            raise DataFormatError(path, line, f"{where}: no annotations")
        parts = []
        for t, triple in enumerate(triples, 1):
            if not (isinstance(triple, list) and len(triple) == 3 and all(isinstance(x, str) for x in triple)):
                raise DataFormatError(path, line, f"{where}, triple {t}: expected [subject, relation, object] strings")
            s, r, o = triple
            parts.append(f"{s} : {r.lower()} : {o}")
        context = " | ".join(parts)
        for j, ann in enumerate(annotations, 1):
            completion = _field(path, line, ann, "text", str, f"{where}, annotation {j}")
            if not allow_empty and not completion.strip():
                raise DataFormatError(path, line, f"{where}, annotation {j}: {EMPTY_REASON}")
            records.append({"context": context, "completion": completion})
    return records


CONVERTERS: dict[str, Callable[..., list[dict]]] = {
    "e2e": convert_e2e,
    "webnlg": convert_webnlg,
    "dart": convert_dart,
    "formatted": read_formatted,
}


def convert(kind: str, path: str | os.PathLike, allow_empty: bool = False) -> list[dict]:
    """Dispatch to a converter by name: ``e2e``, ``webnlg``, ``dart`` or ``formatted``.

    ``allow_empty`` keeps empty completions (see :func:`read_formatted`).

    Raises:
        ValueError: naming the valid kinds when ``kind`` is unknown.
    """
    if kind not in CONVERTERS:
        raise ValueError(f"unknown data kind {kind!r}; choose one of {sorted(CONVERTERS)}")
    return CONVERTERS[kind](path, allow_empty=allow_empty)
