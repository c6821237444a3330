"""Generated token ids -> the evaluators' prediction and reference files.

Semantics of the LoRA paper's ``examples/NLG/src/gpt2_decode.py`` (microsoft/LoRA):

- a text (prediction or reference) is cut at the first ``<|endoftext|>``, then at the
  first ``"\\n\\n"``, then stripped; predictions are first cut at the first stop id;
- one instance per unique context (:func:`lora_core.data.nlg.group_references` order);
- E2E: one prediction line per MR; the reference file lists each MR's references,
  one a line, with a blank line between MRs (the paper also writes one after the
  last MR; we do not, so a file never ends in an empty group). A single MR with
  several references is refused (:func:`check_e2e_groups`): ``measure_scores.py``
  (and ``lora-eval e2e``) read a reference file of one group, with or without a
  blank line after it, as one single-reference instance per line;
- WebNLG/DART: ``reference0`` .. ``reference{N-1}`` in a folder, line ``i`` of file
  ``k`` being reference ``k`` of instance ``i``. An instance with fewer than N
  references is padded with its FIRST reference (``ref[0]``, what gpt2_decode.py
  writes; ``pad="empty"`` writes empty lines instead), and references past N are
  dropped. The paper runs N=6 (``--ref_num 6``); our default is the largest number
  of references of any kept instance, so none is dropped;
- ``tokenize``/``lower``: the paper's ``post_process``: lower-case first, then split
  on every non-word character (``re.split(r"(\\W)")``) and re-join by single spaces.
  It is a regex, not nltk/moses, so no download is needed;
- ``filter``: for WebNLG, keep instances whose ``cate`` is True (``seen``), False
  (``unseen``) or all.

Every file ends with a newline and holds exactly one line per kept instance; all
are written atomically. Imports neither torch nor jittor.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from ..data.nlg import DataFormatError, ReferenceGroup, iter_lines, write_text_atomic

__all__ = [
    "clean_text",
    "cut_at_stop",
    "post_process",
    "check_e2e_groups",
    "decode_predictions",
    "read_beam_jsonl",
    "filter_groups",
    "write_e2e_files",
    "write_multi_ref_files",
    "make_eval_files",
]

RefType = Literal["e2e", "webnlg", "dart"]
Filter = Literal["all", "seen", "unseen"]
_EOS_TEXT = "<|endoftext|>"


_LINE_BREAK = re.compile(r"\s*(?:\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029])\s*")


def clean_text(text: str) -> str:
    """Cut at the first ``<|endoftext|>``, then at the first ``"\\n\\n"``, then strip.

    Unlike the paper, a line break left inside the text becomes one space, so that
    every instance stays on one line of the evaluator files.
    """
    return _LINE_BREAK.sub(" ", text.split(_EOS_TEXT)[0].split("\n\n")[0].strip())


def cut_at_stop(tokens: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """``tokens`` up to (not including) the first id in ``stop_ids``."""
    stops = set(stop_ids)
    for i, t in enumerate(tokens):
        if t in stops:
            return list(tokens[:i])
    return list(tokens)


def post_process(sent: str, tokenize: bool = False, lower: bool = False) -> str:
    """gpt2_decode.py ``post_process``: optional lower-casing, then optional regex tokenisation."""
    if lower:
        sent = sent.lower()
    if tokenize:
        sent = " ".join(" ".join(re.split(r"(\W)", sent)).split())
    return sent


def decode_predictions(tok, token_lists: Sequence[Sequence[int]]) -> list[str]:
    """Generated ids -> clean prediction texts (cut at stop ids, then :func:`clean_text`).

    Args:
        tok: a :class:`lora_core.data.tokenizer.Tokenizer` (``decode``, ``stop_ids``).
        token_lists: generated tokens per instance, prompt excluded.
    """
    return [clean_text(tok.decode(cut_at_stop(ids, tok.stop_ids))) for ids in token_lists]


def read_beam_jsonl(path: str | os.PathLike, n_expected: int, vocab_size: int | None = None) -> list[list[int]]:
    """Read beam-search output: one ``{"index": k, "tokens": [ids]}`` line per unique context.

    Args:
        path: the JSONL file.
        n_expected: the number of unique contexts (``len(group_references(...))``).
        vocab_size: when given, every id must be below it.

    Returns:
        Token lists ordered by ``index``.

    Raises:
        DataFormatError: on a bad line, an index out of range or repeated, or a count
            that differs from ``n_expected``.
    """
    out: list[list[int] | None] = [None] * n_expected
    n_lines = 0
    for lineno, text in iter_lines(path):
        n_lines += 1
        try:
            obj = json.loads(text.rstrip("\r\n"))  # without the line break: a column on this line
        except json.JSONDecodeError as e:
            cut = "truncated: the file ends inside this line; " if not text.endswith("\n") else ""
            raise DataFormatError(path, lineno, f"{cut}broken JSON: {e.msg} at column {e.colno}") from None
        if not isinstance(obj, dict) or "index" not in obj or "tokens" not in obj:
            raise DataFormatError(path, lineno, "expected an object with 'index' and 'tokens'")
        k, ids = obj["index"], obj["tokens"]
        if type(k) is not int or not 0 <= k < n_expected:
            raise DataFormatError(path, lineno, f"index {k!r} is not in [0, {n_expected})")
        if out[k] is not None:
            raise DataFormatError(path, lineno, f"index {k} appears twice")
        if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < (vocab_size or 1 << 62) for i in ids):
            raise DataFormatError(path, lineno, "'tokens' must be a list of valid token ids")
        out[k] = ids
    if n_lines != n_expected:
        missing = [k for k, v in enumerate(out) if v is None][:5]
        cut = "; was the file cut short?" if n_lines < n_expected else ""
        raise DataFormatError(
            path,
            None,
            f"{n_lines} predictions for {n_expected} unique contexts (first missing indices: {missing}){cut}",
        )
    return out  # type: ignore[return-value]


def filter_groups(groups: Sequence[ReferenceGroup], hypotheses: Sequence[str], filter: Filter = "all"):
    """Keep the (group, hypothesis) pairs selected by ``filter`` (WebNLG ``cate``).

    Raises:
        ValueError: on an unknown filter, mismatched lengths, or ``seen``/``unseen``
            on groups without ``cate``.
    """
    if filter not in ("all", "seen", "unseen"):
        raise ValueError(f"unknown filter {filter!r}; choose one of ['all', 'seen', 'unseen']")
    if len(groups) != len(hypotheses):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(groups)} unique contexts")
    if filter == "all":
        return list(groups), list(hypotheses)
    if any(g.cate is None for g in groups):
        raise ValueError(f"filter={filter!r} needs a 'cate' field on every record (WebNLG only)")
    want = filter == "seen"
    kept = [(g, h) for g, h in zip(groups, hypotheses) if g.cate == want]
    return [g for g, _ in kept], [h for _, h in kept]


def _lines(lines: Sequence[str]) -> str:
    return "".join(line + "\n" for line in lines)


def check_e2e_groups(groups: Sequence[ReferenceGroup], option: str = "--ref-type e2e") -> None:
    """Refuse E2E instances that no reference file can hold: one MR with several references.

    ``measure_scores.py`` (tuetschek/e2e-metrics) splits the reference file into groups at
    blank lines, drops one trailing empty group, and takes a file of ONE group for a
    single-reference file (``data_ref = [[inst] for inst in data_ref[0]]``): each reference
    becomes an instance of its own and the counts no longer match the one prediction; a
    blank line before or after the group makes an empty instance instead. ``lora-eval e2e``
    reads the file the same way (``eval.inputs.group_e2e_references``).

    Args:
        groups: the instances to score.
        option: what the message starts with: the option that asked for E2E files.

    Raises:
        ValueError: naming the MR, its number of references, the reason and what to do.
    """
    if len(groups) == 1 and len(groups[0].references) > 1:
        g = groups[0]
        raise ValueError(
            f"{option}: the test set holds a single MR ({g.context!r}) with {len(g.references)} references; "
            f"measure_scores.py and lora-eval e2e read a reference file of one group (with or without a blank line "
            f"after it) as {len(g.references)} single-reference instances, which do not match the one prediction, "
            f"and no layout of the file makes it one multi-reference instance: decode and score a test set of at "
            f"least two MRs (or keep one reference of this MR)"
        )


def write_e2e_files(
    groups: Sequence[ReferenceGroup],
    hypotheses: Sequence[str],
    ref_path: str | os.PathLike,
    pred_path: str | os.PathLike,
    tokenize: bool = False,
    lower: bool = False,
) -> None:
    """E2E layout: ``pred_path`` one line per MR; ``ref_path`` references grouped by MR.

    Args:
        groups: unique MRs with their references (raw completions; cleaned here).
        hypotheses: clean predictions, one per group.
        ref_path, pred_path: output files.
        tokenize, lower: :func:`post_process` options.

    Raises:
        ValueError: before writing anything, on mismatched lengths, a single MR with several
            references (:func:`check_e2e_groups`) or a reference empty after cleaning.
    """
    if len(groups) != len(hypotheses):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(groups)} unique contexts")
    check_e2e_groups(groups)
    pp = lambda s: post_process(s, tokenize, lower)  # noqa: E731
    blocks = []
    for i, g in enumerate(groups):
        refs = [pp(clean_text(r)) for r in g.references]
        if not all(refs):
            raise ValueError(f"instance {i} ({g.context!r}) has a reference that is empty after cleaning")
        blocks.append(_lines(refs))
    write_text_atomic(ref_path, "\n".join(blocks))
    write_text_atomic(pred_path, _lines([pp(h) for h in hypotheses]))


def write_multi_ref_files(
    groups: Sequence[ReferenceGroup],
    hypotheses: Sequence[str],
    ref_dir: str | os.PathLike,
    pred_path: str | os.PathLike,
    ref_num: int | None = None,
    pad: Literal["first", "empty"] = "first",
    tokenize: bool = False,
    lower: bool = False,
) -> int:
    """WebNLG/DART layout: ``ref_dir/reference0..N-1`` and ``pred_path``.

    Args:
        groups, hypotheses: as :func:`write_e2e_files` (already filtered).
        ref_dir: output folder; stale ``reference{k}`` files with ``k >= N`` are removed.
        pred_path: prediction file.
        ref_num: N; None = the most references of any group (the paper used 6).
        pad: fill for missing references: ``"first"`` (paper) or ``"empty"``.
        tokenize, lower: :func:`post_process` options.

    Returns:
        N, the number of reference files written.
    """
    if len(groups) != len(hypotheses):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(groups)} unique contexts")
    if pad not in ("first", "empty"):
        raise ValueError(f"unknown pad {pad!r}; choose 'first' or 'empty'")
    n = ref_num if ref_num is not None else max((len(g.references) for g in groups), default=1)
    if n < 1:
        raise ValueError(f"ref_num must be >= 1, got {n}")
    pp = lambda s: post_process(s, tokenize, lower)  # noqa: E731
    columns: list[list[str]] = [[] for _ in range(n)]
    for g in groups:
        refs = [pp(clean_text(r)) for r in g.references]
        for k in range(n):
            columns[k].append(refs[k] if k < len(refs) else (refs[0] if pad == "first" else ""))
    ref_dir = Path(ref_dir)
    ref_dir.mkdir(parents=True, exist_ok=True)
    for stale in ref_dir.glob("reference*"):
        suffix = stale.name[len("reference") :]
        if suffix.isdigit() and int(suffix) >= n:
            stale.unlink()
    for k, col in enumerate(columns):
        write_text_atomic(ref_dir / f"reference{k}", _lines(col))
    write_text_atomic(pred_path, _lines([pp(h) for h in hypotheses]))
    return n


def make_eval_files(
    tok,
    beam_path: str | os.PathLike,
    records: Sequence[dict],
    ref_type: RefType,
    ref_out: str | os.PathLike,
    pred_out: str | os.PathLike,
    filter: Filter = "all",
    ref_num: int | None = None,
    pad: Literal["first", "empty"] = "first",
    tokenize: bool = False,
    lower: bool = False,
    source: str = "<records>",
) -> dict:
    """Beam-search JSONL + the formatted test records -> the evaluator's files.

    Args:
        tok: the :class:`lora_core.data.tokenizer.Tokenizer` used for encoding.
        beam_path: ``{"index", "tokens"}`` lines, one per unique context of ``records``.
        records: formatted test records (``context``, ``completion``[, ``cate``]).
        ref_type: ``e2e`` (``ref_out`` is a file) or ``webnlg``/``dart`` (a folder).
        ref_out, pred_out: outputs.
        filter, ref_num, pad, tokenize, lower: see :func:`filter_groups`,
            :func:`write_multi_ref_files`, :func:`post_process`. The paper runs E2E
            with neither ``tokenize`` nor ``lower``, WebNLG/DART with both and N=6.
        source: name of ``records``' file for error messages.

    Returns:
        ``{"instances": kept instances, "references": N (1 line per ref for e2e: None)}``.
    """
    from ..data.nlg import group_references

    if ref_type not in ("e2e", "webnlg", "dart"):
        raise ValueError(f"unknown ref_type {ref_type!r}; choose one of ['e2e', 'webnlg', 'dart']")
    groups = group_references(records, source)
    hyps = decode_predictions(tok, read_beam_jsonl(beam_path, len(groups), tok.vocab_size))
    groups, hyps = filter_groups(groups, hyps, filter)
    if ref_type == "e2e":
        write_e2e_files(groups, hyps, ref_out, pred_out, tokenize, lower)
        return {"instances": len(groups), "references": None}
    n = write_multi_ref_files(groups, hyps, ref_out, pred_out, ref_num, pad, tokenize, lower)
    return {"instances": len(groups), "references": n}
