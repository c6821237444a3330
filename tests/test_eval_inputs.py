"""How the evaluator reads E2E, WebNLG and DART files: final newline or not, CRLF,
ragged reference files, lines the official readers would split.

The reference behaviour is the official scorers' reading: GenerationEval's ``eval.py``
splits every file with ``read().split('\\n')`` (a final newline adds an empty entry),
``multi-bleu-detok.perl`` reads Perl lines (a final newline adds none), chrF.py and
``measure_scores.py`` read through Python's ``codecs`` line splitting. What those
readers align is accepted and scored as they score it; what they would mis-align is
refused with the file, the line and the counts. None of these tests needs Java.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import eval as ev
from eval.inputs import align_reference_files, read_line_file
from eval.mteval import multi_bleu_detok

NO_JAVA = "BLEU,TER,chrF++"


def _write(path: Path, data: str) -> Path:
    path.write_bytes(data.encode("utf-8"))
    return path


def _files(tmp_path: Path, **texts: str) -> dict[str, Path]:
    return {name: _write(tmp_path / name, text) for name, text in texts.items()}


# ---------------------------------------------------------------- line files
@pytest.mark.parametrize(
    ("text", "lines", "entries"),
    [
        ("x\ny\n", ["x", "y"], 3),  # eval.py: ['x', 'y', '']
        ("x\ny", ["x", "y"], 2),
        ("x\n\ny\n", ["x", "", "y"], 4),
        ("x\r\ny\r\n", ["x\r", "y\r"], 3),  # CR kept, as eval.py keeps it
        ("", [], 1),
        ("\n", [""], 2),
    ],
)
def test_line_file_lines_and_eval_py_entries(tmp_path, text, lines, entries):
    f = read_line_file(_write(tmp_path / "f", text))
    assert (f.lines, f.entries) == (lines, entries)
    assert len(text.split("\n")) == entries


# ---------------------------------------------------------------- WebNLG / DART: accepted
def test_dart_layout_last_reference_empty(tmp_path):
    """DART's reference files: reference2 is one line short and alone ends with a newline;
    eval.py gives the last instance an empty third reference."""
    first = ["a b c d e", "a b c d f", "a b c d e"]
    r0, r1 = "x y z w v u t", "x y z w v u s"
    f = _files(tmp_path, r0=f"a b c d e\n{r0}", r1=f"a b c d f\n{r1}", r2="a b c d e\n", hyp="a b c d e\nx y")
    refs = align_reference_files([read_line_file(f[k]) for k in ("r0", "r1", "r2")])
    assert refs == [first, [r0, r1, None]]
    ours = ev.score_dart([f["r0"], f["r1"], f["r2"]], f["hyp"], metrics=NO_JAVA, per_instance=True)
    assert len(ours.pop("per_instance")) == 2
    hyps, as_eval_py = ["a b c d e", "x y"], [first, [r0, r1, ""]]
    lists = ev.score_dart_lists(as_eval_py, hyps, metrics="TER,chrF++")
    assert (ours["TER"], ours["chrF++"]) == (lists["TER"], lists["chrF++"])
    # multi-bleu-detok reads one line fewer from r2: no third reference rather than an
    # empty one (which would be the closest length, 0, for the two-word hypothesis)
    perl = multi_bleu_detok(hyps, [first, [r0, r1]])[0]
    assert ours["BLEU"] == perl != multi_bleu_detok(hyps, as_eval_py)[0]
    assert ev.score_dart_lists([first, [r0, r1, None]], hyps, metrics="BLEU")["BLEU"] == perl


@pytest.mark.parametrize("nl", ["\n", "\r\n"])
def test_same_lines_final_newline_in_some_files_only(tmp_path, nl):
    f = _files(tmp_path, r0=f"a b{nl}c d{nl}", r1=f"a c{nl}c e", hyp=f"a b{nl}c d{nl}")
    refs = align_reference_files([read_line_file(f["r0"]), read_line_file(f["r1"])])
    assert [[r.rstrip("\r") for r in rs] for rs in refs] == [["a b", "a c"], ["c d", "c e"]]
    ours = ev.score_webnlg([f["r0"], f["r1"]], f["hyp"], metrics="BLEU,TER", per_instance=True)
    assert len(ours["per_instance"]) == 2 and ours["TER"] == 0.0


def test_every_file_with_final_newline_adds_no_instance(tmp_path):
    """The paper code's decode output: eval.py would add an empty instance; we do not."""
    f = _files(tmp_path, r0="a b\nc d\n", r1="a c\n\n", hyp="a b\nc d\n", bare="a b\nc d")
    for hyp in (f["hyp"], f["bare"]):
        rows = ev.score_webnlg([f["r0"], f["r1"]], hyp, metrics=NO_JAVA, per_instance=True)["per_instance"]
        assert len(rows) == 2 and rows[1]["TER"] == 0.0


# ---------------------------------------------------------------- WebNLG / DART: refused
@pytest.mark.parametrize(
    ("r0", "r2", "why"),
    [
        ("a\nb", "a", "r2 one line short without a final newline: eval.py's entries 2 and 1"),
        ("a\nb\nc", "a\n", "two lines short"),
        ("a\nb\n", "a\n", "the longer file ends with a newline too: entries 3 and 2"),
    ],
)
def test_reference_files_eval_py_would_misalign(tmp_path, r0, r2, why):
    f = _files(tmp_path, r0=r0, r2=r2, hyp=r0)
    with pytest.raises(ev.EvalInputError) as err:
        ev.score_dart([f["r0"], f["r2"]], f["hyp"], metrics="BLEU")
    msg = str(err.value)
    n0, n2 = len(read_line_file(f["r0"]).lines), len(read_line_file(f["r2"]).lines)
    assert "reference files differ in length" in msg, why
    assert f"{f['r0']} has {n0} lines but {f['r2']} has {n2}" in msg and f"line {n2 + 1}:" in msg, msg
    assert "empty last reference" in msg


def test_dart_layout_hypothesis_counts(tmp_path):
    refs = _files(tmp_path, r0="a\nb\nc", r1="a\nb\n")
    ok = _write(tmp_path / "ok", "a\nb\nc\n")  # its final newline is not an instance
    assert len(ev.score_dart(list(refs.values()), ok, metrics="BLEU", per_instance=True)["per_instance"]) == 3
    for text, n, first in (("a\nb\n", 2, "r0 line 3: 'c'"), ("a\nb\nc\n\n", 4, "line 4: ''")):
        hyp = _write(tmp_path / "hyp", text)
        with pytest.raises(ev.EvalInputError) as err:
            ev.score_dart(list(refs.values()), hyp, metrics="BLEU")
        msg = str(err.value)
        assert f"{hyp} has {n} hypotheses" in msg and f"{refs['r0']} has 3 lines" in msg and first in msg, msg


# ---------------------------------------------------------------- WebNLG / DART: CRLF and line breaks
def _crlf(text: str) -> str:
    return text.replace("\n", "\r\n")


def test_webnlg_crlf_scores_like_lf_where_chrf_reads_it_so(tmp_path):
    lf = _files(tmp_path, r0="the cat sat .\na dog runs\n", r1="a cat sat .\n\n", hyp="the cat sat\na dog ran\n")
    crlf = {k: _write(tmp_path / f"crlf_{k}", _crlf(v.read_text())) for k, v in lf.items()}
    want = ev.score_webnlg([lf["r0"], lf["r1"]], lf["hyp"], metrics=NO_JAVA)
    # CRLF hypotheses, and one reference file: chrF.py sees CR LF, one line end
    assert ev.score_webnlg([lf["r0"], lf["r1"]], crlf["hyp"], metrics=NO_JAVA) == want
    one = ev.score_webnlg([lf["r0"]], lf["hyp"], metrics=NO_JAVA)
    assert ev.score_webnlg([crlf["r0"]], crlf["hyp"], metrics=NO_JAVA) == one
    # CRLF references, two of them non-blank in an instance: eval.py joins them with
    # '*#' after the CR, and chrF.py's codecs reading breaks the line at that CR
    assert ev.score_webnlg([crlf["r0"], crlf["r1"]], crlf["hyp"], metrics="BLEU,TER") == {
        k: want[k] for k in ("BLEU", "TER")
    }
    with pytest.raises(ev.EvalInputError) as err:
        ev.score_webnlg([crlf["r0"], crlf["r1"]], crlf["hyp"], metrics=NO_JAVA)
    msg = str(err.value)
    assert f"{crlf['r0']} line 1 contains U+000D CR (column 14)" in msg and "chrF++" in msg


@pytest.mark.parametrize("ch", ["\u2028", "\x85", "\x0c", "\r"])
def test_webnlg_text_that_chrf_would_split(tmp_path, ch):
    f = _files(tmp_path, r0="a b\nc d", hyp=f"a b\nc{ch}d")
    assert set(ev.score_webnlg([f["r0"]], f["hyp"], metrics="BLEU,TER")) == {"BLEU", "TER"}
    with pytest.raises(
        ev.EvalInputError, match=rf"{re.escape(str(f['hyp']))} line 2 contains U\+{ord(ch):04X} .*column 2"
    ):
        ev.score_webnlg([f["r0"]], f["hyp"], metrics="chrF++")
    with pytest.raises(ev.EvalInputError, match="hypothesis 2 contains"):
        ev.score_webnlg_lists([["a b"], ["c d"]], ["a b", f"c{ch}d"], metrics="chrF++")
    # a blank reference is not written for chrF.py: nothing to split
    blank = ev.score_webnlg_lists([["a b", "\u2028"]], ["a b"], metrics="chrF++")
    assert blank == ev.score_webnlg_lists([["a b", ""]], ["a b"], metrics="chrF++")


# ---------------------------------------------------------------- E2E (measure_scores.py reading)
E2E_REFS = "the eagle is a pub .\nthe eagle , a pub .\n\nzizzi is cheap .\nzizzi costs little .\n"
E2E_HYPS = "the eagle is a pub .\nzizzi is cheap .\n"


@pytest.mark.parametrize(
    ("refs", "hyps"),
    [
        (E2E_REFS.rstrip("\n"), E2E_HYPS.rstrip("\n")),  # no final newline
        (E2E_REFS + "\n", E2E_HYPS),  # a blank line after the last group: no empty group
        (_crlf(E2E_REFS), _crlf(E2E_HYPS)),
        (_crlf(E2E_REFS + "\n"), E2E_HYPS.rstrip("\n")),
    ],
)
def test_e2e_final_newline_crlf_and_trailing_blank_line(tmp_path, refs, hyps):
    base = ev.score_e2e(_write(tmp_path / "r", E2E_REFS), _write(tmp_path / "h", E2E_HYPS), metrics="BLEU,NIST")
    got = ev.score_e2e(_write(tmp_path / "r2", refs), _write(tmp_path / "h2", hyps), metrics="BLEU,NIST")
    assert got == base


def test_e2e_single_reference_file_with_trailing_blank_line(tmp_path):
    ref = _write(tmp_path / "r", "the eagle is a pub .\nzizzi is cheap .\n\n")
    rows = ev.score_e2e(ref, _write(tmp_path / "h", E2E_HYPS), metrics="BLEU", per_instance=True)["per_instance"]
    assert len(rows) == 2 and rows[0]["BLEU"] == pytest.approx(1.0)


@pytest.mark.parametrize("ch", ["\r", "\u2028", "\x1e"])
def test_e2e_line_that_measure_scores_would_split(tmp_path, ch):
    ref = _write(tmp_path / "r", E2E_REFS)
    hyp = _write(tmp_path / "h", f"the eagle is a pub .\nzizzi is{ch}cheap .\n")
    with pytest.raises(ev.EvalInputError, match=rf"{re.escape(str(hyp))}: line 2 contains U\+{ord(ch):04X} .*column 9"):
        ev.score_e2e(ref, hyp, metrics="BLEU")
    bad_ref = _write(tmp_path / "r2", E2E_REFS.replace("zizzi costs", f"zizzi{ch}costs"))
    with pytest.raises(ev.EvalInputError, match=rf"{re.escape(str(bad_ref))}: line 5 contains U\+{ord(ch):04X}"):
        ev.score_e2e(bad_ref, _write(tmp_path / "h2", E2E_HYPS), metrics="BLEU")


def test_e2e_extra_blank_lines_stay_refused(tmp_path):
    ref = _write(tmp_path / "r", E2E_REFS + "\n\n")  # measure_scores: an empty group -> 3 vs 2
    with pytest.raises(ev.EvalInputError, match=r"instance 3 \(line 7\) has no reference"):
        ev.score_e2e(ref, _write(tmp_path / "h", E2E_HYPS), metrics="BLEU")
    hyp = _write(tmp_path / "h2", E2E_HYPS + "\n")  # an empty last hypothesis: 3 vs 2
    with pytest.raises(ev.EvalInputError, match=r"3 hypotheses.*has 2 reference.*line 3: ''"):
        ev.score_e2e(_write(tmp_path / "r2", E2E_REFS), hyp, metrics="BLEU")


def test_outputs_that_would_overwrite_inputs_are_refused(tmp_path, capsys):
    """``decode``'s and ``beam``'s outputs apart from their inputs and from each other, checked
    before any work; ``lora-eval --per-instance`` is not one of the files it scores."""
    from eval.cli import main as lora_eval
    from lora_core.data.nlg import check_outputs_apart

    beam, refs = tmp_path / "beam.jsonl", tmp_path / "refs"
    with pytest.raises(ValueError, match=r"--pred-out .*beam.jsonl: is the --beam input"):
        check_outputs_apart([("--pred-out", beam), ("--ref-out", refs)], [("--beam", beam), ("--test", None)])
    with pytest.raises(ValueError, match=r"--pred-out .*reference0 and --ref-out .*refs: the same file, or one inside"):
        check_outputs_apart([("--ref-out", refs), ("--pred-out", refs / "reference0")], [("--beam", beam)])
    check_outputs_apart([("--pred-out", tmp_path / "pred.txt"), ("--ref-out", refs)], [("--beam", beam)])
    hyp = tmp_path / "hyp.txt"
    hyp.write_text("a pub .\n")
    for argv in (["e2e", "--ref", str(tmp_path / "ref.txt"), "--hyp", str(hyp), "--per-instance", str(hyp)],
                 ["webnlg", "--ref-prefix", str(tmp_path / "reference"), "--num-refs", "2", "--hyp", str(hyp),
                  "--per-instance", str(tmp_path / "reference1")]):  # fmt: skip
        assert lora_eval(argv) == 2
        assert "it would be overwritten" in capsys.readouterr().err
    assert hyp.read_text() == "a pub .\n"


def test_e2e_tokens_lowercase_after_the_entities_as_mteval():
    """mteval-v13a decodes ``&quot;`` and the others case-sensitively, then lowercases: an
    upper-case ``&QUOT;`` stays ``& quot ;`` (sacrebleu's ``lowercase=True`` lowercases first)."""
    from eval.mteval import tokenize_e2e

    assert tokenize_e2e('THE &QUOT;EAGLE&QUOT; IS A PUB .') == ["the", "&", "quot", ";", "eagle", "&", "quot", ";",
                                                                 "is", "a", "pub", "."]  # fmt: skip
    assert tokenize_e2e("the &quot;Eagle&quot; &amp; co") == ["the", '"', "eagle", '"', "&", "co"]
