"""Converters, JSONL I/O, bad-input messages, reference grouping and the toy data set."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lora_core.data.convert import convert, convert_dart, convert_e2e, convert_webnlg
from lora_core.data.nlg import (
    DataFormatError,
    group_references,
    read_encoded,
    read_formatted,
    read_jsonl,
    write_jsonl_atomic,
)
from lora_core.data.tokenizer import load_tokenizer
from lora_core.data.toy import make_toy_dataset

ROOT = Path(__file__).resolve().parents[1]


def need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"shared data missing: {path} (set LORA_SHARED)")
    return path


def paper_lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


# --------------------------------------------------------------------------- converters on real data


def test_webnlg_dev_equals_paper_formatted_file(shared_dir):
    """convert_webnlg(dev.json) reproduces the paper's valid_formatted.jsonl byte for byte."""
    records = convert_webnlg(need(shared_dir / "data/webnlg/dev.json"))
    assert len(records) == 2258  # 2268 lexicalisations, 10 not 'good'
    assert [json.dumps(r) for r in records] == paper_lines(shared_dir / "data/webnlg/valid_formatted.jsonl")
    assert all(r["cate"] is True for r in records)  # dev holds only the 10 seen categories


def test_dart_dev_equals_paper_formatted_file(shared_dir):
    records = convert_dart(need(shared_dir / "data/dart/dart-v1.1.1-full-dev.json"))
    assert len(records) == 6980
    assert [json.dumps(r) for r in records] == paper_lines(shared_dir / "data/dart/valid_formatted.jsonl")
    assert any(" : [title] : " in r["context"] for r in records)  # raw relation "[TITLE]", lower-cased


def test_e2e_test_file(shared_dir):
    records = convert_e2e(need(shared_dir / "data/e2e/test.txt"))
    assert len(records) == 4693
    assert records[0] == {
        "context": "name : Blue Spice | Type : coffee shop | area : city centre",
        "completion": "A coffee shop in the city centre area called Blue Spice .",  # line stripped, as the paper
    }
    groups = group_references(records)
    assert len(groups) == 630
    assert sum(len(g.references) for g in groups) == 4693


def test_e2e_small(tmp_path):
    f = tmp_path / "e.txt"
    f.write_text("name : A | food : B||A serves B . \nname : C||C is nice.\n", encoding="utf-8")
    assert convert_e2e(f) == [
        {"context": "name : A | food : B", "completion": "A serves B ."},
        {"context": "name : C", "completion": "C is nice."},
    ]
    assert convert("e2e", f) == convert_e2e(f)
    with pytest.raises(ValueError, match="unknown data kind 'xml'"):
        convert("xml", f)


# --------------------------------------------------------------------------- bad input


def raises_at(fn, path, line, reason):
    with pytest.raises(DataFormatError) as info:
        fn(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}, line {line}: "), msg
    assert reason in msg, msg
    assert info.value.line == line


@pytest.mark.parametrize(
    "text, line, reason",
    [
        ("a||b\nno separator here\n", 2, "no '||'"),
        ("a||b\nc||d\ne||   \n", 3, "empty completion"),
        ("a||b||c\n", 1, "2 '||' separators"),
        ("a||b\n\nc||d\n", 2, "empty line"),
        ("||b\n", 1, "empty MR"),
    ],
)
def test_e2e_bad_lines(tmp_path, text, line, reason):
    f = tmp_path / "bad.txt"
    f.write_text(text, encoding="utf-8")
    raises_at(convert_e2e, f, line, reason)


def test_bad_utf8(tmp_path):
    f = tmp_path / "bad.txt"
    f.write_bytes(b"a||b\nc||\xff\xfe\n")
    raises_at(convert_e2e, f, 2, "not valid UTF-8")


@pytest.mark.parametrize(
    "lines, line, reason",
    [
        (['{"context": "a", "completion": "b"}', '{"context": "a", "completion": '], 2, "broken JSON"),
        (['{"context": [1,2'], 1, "broken JSON: Expecting ',' delimiter at column 17"),  # the column on its line
        (['{"context": "a", "completion": "b"}', '{"context": "a"}'], 2, "missing field 'completion'"),
        (['{"context": "a", "completion": " "}'], 1, "empty completion"),
        (['{"context": "a", "completion": 3}'], 1, "must be a string"),
        (['{"context": "a", "completion": "b", "cate": 1}'], 1, "'cate' must be true or false"),
        (['["context", "completion"]'], 1, "expected a JSON object"),
        (['{"context": "a", "completion": "b"}', ""], 2, "empty line"),
    ],
)
def test_formatted_bad_lines(tmp_path, lines, line, reason):
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")
    raises_at(read_formatted, f, line, reason)


def test_encoded_bad_lines(tmp_path):
    f = tmp_path / "enc.jsonl"
    f.write_text('{"context": [1, 2], "completion": [3]}\n{"context": [1], "completion": [2.5]}\n')
    raises_at(read_encoded, f, 2, "not a token id")
    f.write_text('{"context": [], "completion": [3]}\n')
    raises_at(read_encoded, f, 1, "non-empty list")


def webnlg_doc(entries: list[dict]) -> str:
    return json.dumps({"entries": [{str(i + 1): e} for i, e in enumerate(entries)]}, indent=4)


def webnlg_entry(lex="The leader of Aarhus is Jacob.", comment="good", category="Airport"):
    return {
        "category": category,
        "lexicalisations": [{"comment": comment, "lex": lex}, {"comment": "toFix", "lex": "bad text"}],
        "modifiedtripleset": [
            {"subject": "Aarhus", "property": "leaderName", "object": "Jacob"},
            {"subject": "Aarhus", "property": "country", "object": "Denmark"},
        ],
    }


def test_webnlg_small_and_errors(tmp_path):
    f = tmp_path / "w.json"
    entries = [webnlg_entry(), webnlg_entry(category="Artist", comment="toFix"), webnlg_entry("Hi.", category="Artist")]
    f.write_text(webnlg_doc(entries), encoding="utf-8")
    context = "Aarhus : leaderName : Jacob | Aarhus : country : Denmark"
    assert convert_webnlg(f) == [  # only 'good' lexicalisations; cate: category seen in training
        {"context": context, "completion": "The leader of Aarhus is Jacob.", "cate": True},
        {"context": context, "completion": "Hi.", "cate": False},
    ]
    # entry 2 lacks 'lex': the error points at the line where entry 2 starts
    bad = webnlg_entry()
    del bad["lexicalisations"][0]["lex"]
    text = webnlg_doc([webnlg_entry(), bad])
    f.write_text(text, encoding="utf-8")
    start = text.splitlines().index('            "2": {')  # entry 2's wrapper starts one line above
    raises_at(convert_webnlg, f, start, "entry 2, lexicalisation 1: missing field 'lex'")
    f.write_text(webnlg_doc([webnlg_entry(lex="  ")]), encoding="utf-8")
    raises_at(convert_webnlg, f, 3, "entry 1, lexicalisation 1: empty completion")
    f.write_text('{\n  "entries": [\n    {"1": }\n  ]\n}\n', encoding="utf-8")
    raises_at(convert_webnlg, f, 3, "broken JSON")


def test_dart_small_and_errors(tmp_path):
    f = tmp_path / "d.json"
    ex = {
        "tripleset": [["Mars Hill College", "JOINED", "1973"]],
        "annotations": [{"source": "x", "text": "It joined in 1973."}],
    }
    f.write_text(json.dumps([ex, ex], indent=2), encoding="utf-8")
    assert convert_dart(f) == [{"context": "Mars Hill College : joined : 1973", "completion": "It joined in 1973."}] * 2
    bad = {"tripleset": [["a", "B"]], "annotations": [{"text": "t"}]}
    text = json.dumps([ex, bad], indent=2)
    f.write_text(text, encoding="utf-8")
    line = text.splitlines().index("  {", 2) + 1  # second example's opening brace
    raises_at(convert_dart, f, line, "example 2, triple 1: expected [subject, relation, object]")
    f.write_text(json.dumps([{"tripleset": [["a", "b", "c"]]}]), encoding="utf-8")
    raises_at(convert_dart, f, 1, "example 1: missing field 'annotations'")


# --------------------------------------------------------------------------- JSONL I/O and grouping


def test_write_jsonl_atomic(tmp_path):
    f = tmp_path / "sub" / "x.jsonl"
    recs = [{"context": "Café", "completion": "b"}, {"context": [1, 2], "completion": [3]}]
    write_jsonl_atomic(f, recs)
    assert f.read_bytes() == b'{"context": "Caf\\u00e9", "completion": "b"}\n{"context": [1, 2], "completion": [3]}\n'
    assert read_jsonl(f) == recs
    with pytest.raises(TypeError):  # a failure mid-write keeps the old file and leaves no temp file
        write_jsonl_atomic(f, [{"a": 1}, {"b": object()}])
    assert read_jsonl(f) == recs
    assert os.listdir(f.parent) == ["x.jsonl"]


def test_group_references():
    recs = [
        {"context": "a", "completion": "1"},
        {"context": "b", "completion": "2"},
        {"context": "a", "completion": "3"},  # not consecutive: still grouped, as gpt2_decode.py
        {"context": "c", "completion": "4"},
    ]
    groups = group_references(recs)
    assert [(g.context, g.references, g.cate) for g in groups] == [
        ("a", ["1", "3"], None),
        ("b", ["2"], None),
        ("c", ["4"], None),
    ]
    enc = [
        {"context": [1, 2], "completion": [5]},
        {
            "context": [1, 2],
            "completion": [6],
        },
    ]
    assert [(g.context, g.references) for g in group_references(enc)] == [([1, 2], [[5], [6]])]
    cated = [{"context": "a", "completion": "1", "cate": True}, {"context": "a", "completion": "2", "cate": False}]
    with pytest.raises(DataFormatError, match=r"^t\.jsonl, line 2: cate=False differs"):
        group_references(cated, source="t.jsonl")


# --------------------------------------------------------------------------- toy data set


def test_toy_dataset(tmp_path):
    paths = make_toy_dataset(tmp_path / "a")
    splits = {s: convert_e2e(paths[s]) for s in ("train", "valid", "test")}
    groups = {s: group_references(r) for s, r in splits.items()}
    assert [len(groups[s]) for s in ("train", "valid", "test")] == [1500, 100, 50]
    assert all(2 <= len(g.references) <= 3 for g in groups["test"])
    assert sum(len(g.references) == 3 for g in groups["test"]) >= 40
    contexts = [{g.context for g in groups[s]} for s in groups]
    assert not (contexts[0] & contexts[1] or contexts[0] & contexts[2] or contexts[1] & contexts[2])
    tok = load_tokenizer(tmp_path / "a")
    assert tok.eos_id == 0 and 400 <= tok.vocab_size <= 1000
    for r in splits["test"]:
        for text in (r["context"], " " + r["completion"]):
            assert tok.decode(tok.encode(text)) == text
    # same files byte for byte in a second run, in another process (other hash seeds)
    code = f"from lora_core.data.toy import make_toy_dataset; make_toy_dataset({str(tmp_path / 'b')!r})"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env={**os.environ, "PYTHONHASHSEED": "123"})
    for name, p in paths.items():
        assert (tmp_path / "b" / p.name).read_bytes() == p.read_bytes(), name
    other = make_toy_dataset(tmp_path / "c", seed=1)
    assert other["train"].read_bytes() != paths["train"].read_bytes()
