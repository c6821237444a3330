"""Decode to evaluator files: paper semantics (gpt2_decode.py), file layouts, padding, filters, bad input."""

import json
import os

import pytest

from examples.nlg import decode as decode_cli
from examples.nlg import prepare as prepare_cli
from lora_core.data.nlg import DataFormatError, ReferenceGroup, read_formatted, write_jsonl_atomic
from lora_core.data.tokenizer import load_tokenizer
from lora_core.generate.decode import (
    clean_text,
    cut_at_stop,
    decode_predictions,
    filter_groups,
    make_eval_files,
    post_process,
    read_beam_jsonl,
    write_e2e_files,
    write_multi_ref_files,
)


@pytest.fixture(scope="module")
def gpt2(shared_dir):
    d = shared_dir / "data/gpt2-vocab"
    if not d.is_dir():
        pytest.skip(f"shared GPT-2 vocabulary missing: {d} (set LORA_SHARED)")
    return load_tokenizer(d)


def write_beam(path, token_lists, order=None):
    order = range(len(token_lists)) if order is None else order
    write_jsonl_atomic(path, [{"index": k, "tokens": token_lists[k]} for k in order])


# --------------------------------------------------------------------------- text semantics


def test_clean_and_post_process():
    assert clean_text("  The pub.<|endoftext|>junk") == "The pub."
    assert clean_text("The pub.\n\nMore<|endoftext|>") == "The pub."
    assert clean_text("a\nb \r\n c") == "a b c"  # single line breaks: one space (keeps 1 line per instance)
    assert cut_at_stop([5, 6, 628, 7, 50256], (50256, 628)) == [5, 6]
    assert cut_at_stop([5, 6], (50256, 628)) == [5, 6]
    # the paper's post_process: lower first, then split off every non-word character
    assert post_process("Hello, World's end.", tokenize=True, lower=True) == "hello , world ' s end ."
    assert post_process("Aarhus (Denmark)--1,000 km", tokenize=True) == "Aarhus ( Denmark ) - - 1 , 000 km"
    assert post_process("Café  Ünïcode", lower=True) == "café  ünïcode"
    assert post_process("x", False, False) == "x"


def test_decode_predictions(gpt2):
    body = gpt2.encode(" The Eagle is a pub.")
    preds = decode_predictions(
        gpt2, [body + [628] + gpt2.encode(" junk"), body + [50256, 1, 2], body, body + [198, 198, 3]]
    )
    assert preds == ["The Eagle is a pub."] * 4
    assert decode_predictions(gpt2, [[50256]]) == [""]  # an empty prediction is still one instance


# --------------------------------------------------------------------------- E2E layout


def test_e2e_files(tmp_path):
    groups = [ReferenceGroup("mr1", ["Ref a .", "Ref b .<|endoftext|>"]), ReferenceGroup("mr2", ["Only one ."])]
    write_e2e_files(groups, ["Pred 1 .", ""], tmp_path / "ref.txt", tmp_path / "pred.txt")
    assert (tmp_path / "ref.txt").read_text() == "Ref a .\nRef b .\n\nOnly one .\n"  # no blank line after the last MR
    assert (tmp_path / "pred.txt").read_text() == "Pred 1 .\n\n"  # 2 lines; the second prediction is empty
    write_e2e_files(groups, ["Pred 1 .", "x"], tmp_path / "ref.txt", tmp_path / "pred.txt", tokenize=True, lower=True)
    assert (tmp_path / "ref.txt").read_text() == "ref a .\nref b .\n\nonly one .\n"
    with pytest.raises(ValueError, match="1 hypotheses for 2 unique contexts"):
        write_e2e_files(groups, ["p"], tmp_path / "ref.txt", tmp_path / "pred.txt")
    with pytest.raises(ValueError, match="empty after cleaning"):
        write_e2e_files([ReferenceGroup("m", ["<|endoftext|>"])], ["p"], tmp_path / "r", tmp_path / "p")


def read_e2e_refs(path):
    """The e2e-metrics reader: groups separated by blank lines."""
    groups = [[]]
    for line in path.read_text(encoding="utf-8").split("\n"):
        if line.strip():
            groups[-1].append(line)
        elif groups[-1]:
            groups.append([])
    return [g for g in groups if g]


def test_e2e_end_to_end(shared_dir, gpt2, tmp_path):
    """Shared E2E test (630 MRs): oracle predictions (each MR's first reference) through the whole path."""
    from lora_core.data.convert import convert_e2e
    from lora_core.data.nlg import group_references

    test = shared_dir / "data/e2e/test.txt"
    records = convert_e2e(test)
    groups = group_references(records)
    beam = tmp_path / "beam.jsonl"
    write_beam(
        beam, [gpt2.encode(" " + g.references[0]) + [50256] for g in groups], order=range(len(groups) - 1, -1, -1)
    )
    info = make_eval_files(gpt2, beam, records, "e2e", tmp_path / "ref.txt", tmp_path / "pred.txt")
    assert info == {"instances": 630, "references": None}
    preds = (tmp_path / "pred.txt").read_text(encoding="utf-8").split("\n")
    assert preds[-1] == "" and len(preds) == 631  # 630 lines, final newline
    assert preds[:-1] == [g.references[0].strip() for g in groups]
    refs = read_e2e_refs(tmp_path / "ref.txt")
    assert len(refs) == 630 and sum(map(len, refs)) == 4693
    assert refs[0][0] == "A coffee shop in the city centre area called Blue Spice ."


# --------------------------------------------------------------------------- WebNLG / DART layout


def groups3():
    return [
        ReferenceGroup("c1", ["A1", "A2", "A3"], cate=True),
        ReferenceGroup("c2", ["B1"], cate=False),
        ReferenceGroup("c3", ["C1", "C2"], cate=True),
    ]


def lines(path):
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return text[:-1].split("\n")


def test_multi_ref_padding_and_truncation(tmp_path):
    refs, pred = tmp_path / "refs", tmp_path / "pred.txt"
    assert write_multi_ref_files(groups3(), ["p1", "p2", "p3"], refs, pred) == 3
    assert sorted(os.listdir(refs)) == ["reference0", "reference1", "reference2"]
    # gpt2_decode.py pads a missing reference with the instance's FIRST reference
    assert [lines(refs / f"reference{k}") for k in range(3)] == [
        ["A1", "B1", "C1"],
        ["A2", "B1", "C2"],
        ["A3", "B1", "C1"],
    ]
    assert lines(pred) == ["p1", "p2", "p3"]
    # pad="empty": empty lines; ref_num=2 (paper: 6) drops references past N and the stale reference2
    assert write_multi_ref_files(groups3(), ["p1", "p2", "p3"], refs, pred, ref_num=2, pad="empty") == 2
    assert sorted(os.listdir(refs)) == ["reference0", "reference1"]
    assert (refs / "reference1").read_text() == "A2\n\nC2\n"
    with pytest.raises(ValueError, match="unknown pad"):
        write_multi_ref_files(groups3(), ["p1", "p2", "p3"], refs, pred, pad="zero")


def test_filters():
    g, h = filter_groups(groups3(), ["p1", "p2", "p3"], "seen")
    assert [x.context for x in g] == ["c1", "c3"] and h == ["p1", "p3"]
    g, h = filter_groups(groups3(), ["p1", "p2", "p3"], "unseen")
    assert [x.context for x in g] == ["c2"] and h == ["p2"]
    assert len(filter_groups(groups3(), ["p1", "p2", "p3"], "all")[0]) == 3
    with pytest.raises(ValueError, match="needs a 'cate'"):
        filter_groups([ReferenceGroup("c", ["r"])], ["p"], "seen")
    with pytest.raises(ValueError, match="unknown filter"):
        filter_groups(groups3(), ["p1", "p2", "p3"], "new")


@pytest.mark.parametrize("name, n_inputs, n_refs", [("webnlg", 1862, 8), ("dart", 4159, 35)])
def test_multi_ref_end_to_end(name, n_inputs, n_refs, shared_dir, gpt2, tmp_path):
    """Shared WebNLG/DART test sets through make_eval_files with the paper's --tokenize --lower."""
    from lora_core.data.nlg import group_references

    test = shared_dir / f"data/{name}/test_formatted.jsonl"
    records = read_formatted(test, allow_empty=True)
    groups = group_references(records, str(test))
    assert len(groups) == n_inputs
    beam = tmp_path / "beam.jsonl"
    write_beam(beam, [gpt2.encode(" " + g.references[-1]) + [628] for g in groups])
    counts = {}
    for flt in ("all", "seen", "unseen") if name == "webnlg" else ("all",):
        out = tmp_path / flt
        info = make_eval_files(
            gpt2, beam, records, name, out / "refs", out / "hyp", filter=flt, tokenize=True, lower=True
        )
        counts[flt] = info["instances"]
        hyp = lines(out / "hyp")
        assert len(hyp) == info["instances"]
        for k in range(info["references"]):
            assert len(lines(out / "refs" / f"reference{k}")) == info["instances"]
    assert counts["all"] == n_inputs
    if name == "webnlg":
        assert counts["seen"] + counts["unseen"] == n_inputs and counts["seen"] > 0 and counts["unseen"] > 0
    info = make_eval_files(
        gpt2, beam, records, name, tmp_path / "r6", tmp_path / "h6", ref_num=6, tokenize=True, lower=True
    )
    assert info["references"] == 6 and n_refs > 6
    hyp = lines(tmp_path / "h6")
    assert hyp[0] == post_process(groups[0].references[-1].strip(), True, True)


# --------------------------------------------------------------------------- bad beam files


def test_read_beam_errors(tmp_path):
    beam = tmp_path / "beam.jsonl"
    write_beam(beam, [[1], [2], [3]])
    assert read_beam_jsonl(beam, 3) == [[1], [2], [3]]
    with pytest.raises(
        DataFormatError, match=rf"^{beam}: 3 predictions for 4 unique contexts \(first missing indices: \[3\]\)"
    ):
        read_beam_jsonl(beam, 4)
    with pytest.raises(DataFormatError, match=rf"^{beam}, line 3: index 2 is not in \[0, 2\)"):
        read_beam_jsonl(beam, 2)
    beam.write_text('{"index": 0, "tokens": [1]}\n{"index": 0, "tokens": [2]}\n')
    with pytest.raises(DataFormatError, match=rf"^{beam}, line 2: index 0 appears twice"):
        read_beam_jsonl(beam, 2)
    beam.write_text('{"index": 0, "tokens": [1]}\n{"index": 1, "tokens": [2, "x"]}\n')
    with pytest.raises(DataFormatError, match="line 2: 'tokens' must be a list of valid token ids"):
        read_beam_jsonl(beam, 2)
    beam.write_text('{"index": 0, "tokens": [1]}\n{"index": 1, "tokens": [99]}\n')
    with pytest.raises(DataFormatError, match="line 2: 'tokens' must be"):
        read_beam_jsonl(beam, 2, vocab_size=50)
    beam.write_text('{"index": 0, "tokens": [1]}\n{"index": 1\n')
    with pytest.raises(DataFormatError, match="line 2: broken JSON"):
        read_beam_jsonl(beam, 2)
    beam.write_text('{"index": 0, "predict": [1]}\n')
    with pytest.raises(DataFormatError, match="line 1: expected an object with 'index' and 'tokens'"):
        read_beam_jsonl(beam, 1)


# --------------------------------------------------------------------------- CLIs on the toy data set


def test_prepare_and_decode_cli_on_toy(tmp_path, capsys):
    out = tmp_path / "toy"
    assert prepare_cli.main(["toy", "--out-dir", str(out), "--no-progress"]) == 0
    for split in ("train", "valid", "test"):
        assert (out / f"{split}.jsonl").is_file() and (out / f"{split}_formatted.jsonl").is_file()
    tok = load_tokenizer(out)
    records = read_formatted(out / "test_formatted.jsonl")
    encoded = [json.loads(line) for line in (out / "test.jsonl").read_text().splitlines()]
    assert encoded[0]["context"][-1] == tok.eos_id == encoded[0]["completion"][-1]
    contexts = list(dict.fromkeys(r["context"] for r in records))
    first = {}
    for r in records:
        first.setdefault(r["context"], r["completion"])
    write_beam(tmp_path / "beam.jsonl", [tok.encode(" " + first[c]) + [tok.eos_id, 5, 6] for c in contexts])
    args = ["--vocab", str(out), "--beam", str(tmp_path / "beam.jsonl"), "--test", str(out / "test.txt")]
    args += ["--ref-type", "e2e", "--ref-out", str(tmp_path / "ref.txt"), "--pred-out", str(tmp_path / "pred.txt")]
    assert decode_cli.main(args) == 0
    assert lines(tmp_path / "pred.txt") == [first[c] for c in contexts]
    assert len(read_e2e_refs(tmp_path / "ref.txt")) == len(contexts) == 50
    # errors: a message naming the file, exit status 1
    capsys.readouterr()
    write_beam(tmp_path / "beam.jsonl", [[1]] * 49)
    assert decode_cli.main(args) == 1
    assert f"error: {tmp_path / 'beam.jsonl'}: 49 predictions for 50 unique contexts" in capsys.readouterr().err
    bad = tmp_path / "bad.txt"
    bad.write_text("name : X||ok\nname : Y\n")
    assert (
        prepare_cli.main(["e2e", "--vocab", str(out), "--out-dir", str(tmp_path / "o"), "--no-progress", str(bad)]) == 1
    )
    assert f"error: {bad}, line 2: no '||'" in capsys.readouterr().err
    # an input of no examples: refused, naming the file (it had written empty splits)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    argv = ["e2e", "--vocab", str(out), "--out-dir", str(tmp_path / "o"), "--no-progress", f"train={empty}"]
    assert prepare_cli.main(argv) == 1
    assert f"error: {empty}: no examples in the file (train split)" in capsys.readouterr().err
