"""Bad input to the NLG commands refused before any work, naming the option or the line: a
training example longer than the model's positions or holding an id outside its vocabulary
(``LMTask.check``, before the run folder); a ``--test`` context too long to decode
(``examples.nlg.beam``, before the first batch); one MR of several references, which no E2E
reference file can hold (``write_e2e_files``); a negative ``--test-limit`` (``examples.nlg.demo``);
and a bare ``PATH`` holding "=" for ``examples.nlg.prepare``. Torch only: none of it is backend
code."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import lora_core
from eval.inputs import group_e2e_references, read_e2e_references
from examples.nlg import beam as beam_cli
from examples.nlg import decode as decode_cli
from examples.nlg import demo as demo_cli
from examples.nlg import prepare as prepare_cli
from examples.nlg import train as train_cli
from lora_core.data.nlg import ReferenceGroup, write_jsonl_atomic
from lora_core.data.tokenizer import load_tokenizer
from lora_core.data.toy import make_toy_dataset
from lora_core.generate.beam import BeamConfig
from lora_core.generate.decode import write_e2e_files
from lora_core.train.tasks import LMTask


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> dict:
    """The toy data set's tokenizer (512 ids) and raw files."""
    return make_toy_dataset(tmp_path_factory.mktemp("toy"))


def _pair(n_context: int, n_completion: int, top: int = 7) -> dict:
    return {"context": [5] * (n_context - 1) + [top], "completion": [6] * n_completion}


# --------------------------------------------------------------------------- 1, 2: LMTask.check


@pytest.mark.parametrize(
    "where, bad, message",
    [
        ("train", _pair(30, 100), "training example 3 has 129 input tokens (context 30 + completion 100 - 1), "
                                  "more than the model's 128 positions"),
        ("valid", _pair(4, 3, top=600), "validation example 3: token id 600 outside the model's vocabulary of 512"),
    ],
    ids=["too-long", "out-of-vocabulary"],
)  # fmt: skip
def test_train_refuses_a_bad_example_before_the_run_folder(tmp_path, capsys, where, bad, message):
    """The reviewer's repro: the example was refused only when its batch was collated, after
    checkpoints were written, named by its index in the batch; an id outside the vocabulary
    named neither the set nor the line."""
    files = {s: tmp_path / f"{s}.jsonl" for s in ("train", "valid")}
    for split, path in files.items():
        write_jsonl_atomic(path, [_pair(4, 3)] * 2 + ([bad] if split == where else [_pair(4, 3)]) + [_pair(5, 2)])
    out = tmp_path / "run"
    argv = ["--backend", "torch", "--recipe", "toy", "--train", str(files["train"]), "--valid", str(files["valid"])]
    argv += ["--random-init", "tiny", "--vocab-size", "512", "--no-progress", "--out-dir", str(out)]
    capsys.readouterr()
    assert train_cli.main([*argv, "--set", "batch_size=2", "epochs=1", "save_every=1", "log_every=1"]) == 1
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_lm_check_limits_and_names():
    """Exactly the model's positions of input tokens is accepted (the model reads seq[:-1]), one
    more is not; GPT-2's n_positions or a Llama's max_position_embeddings; ids below 0 too."""
    task = LMTask()
    gpt2 = SimpleNamespace(config=SimpleNamespace(vocab_size=50, n_positions=16))
    llama = SimpleNamespace(config=SimpleNamespace(vocab_size=50, max_position_embeddings=16))
    for model in (gpt2, llama):
        task.check([([1] * 10, [2] * 7)], model, "x")  # 16 input tokens
        with pytest.raises(ValueError, match=r"^dev.jsonl line 2 has 17 input tokens .* model's 16 positions"):
            task.check([([1], [2]), ([1] * 10, [2] * 8)], model, "dev.jsonl line")
    with pytest.raises(ValueError, match="^example 1: token id -1 outside the model's vocabulary of 50"):
        task.check([([1, -1], [2])], gpt2)
    with pytest.raises(ValueError, match="^example 2: token id 50 outside"):
        task.check([([1], [2]), ([1], [50])], gpt2)
    with pytest.raises(ValueError, match="^example 1 has an empty completion"):
        task.check([([1], [])], gpt2)


# --------------------------------------------------------------------------- 3: beam


def test_beam_refuses_a_long_context_before_decoding(tmp_path, toy, capsys, monkeypatch):
    """A --test context whose prompt and max_new_tokens pass the positions is refused, naming
    its line, before the model decodes anything (it was found when its batch came)."""
    backend = lora_core.get_backend("torch")
    cfg = lora_core.gpt2_config("tiny", vocab_size=512, n_positions=64)
    lora_core.save_model(tmp_path / "base", cfg, lora_core.init_gpt2_weights(cfg, 0))
    long = " | ".join(["name : The Lantern"] * 12)
    tok = load_tokenizer(toy["tokenizer"])
    assert len(tok.encode(long)) + 1 + 7 > 64
    rows = [("name : A", "a"), ("name : B", "b"), ("name : A", "c"), (long, "d")]
    test = tmp_path / "test.jsonl"
    test.write_text("".join(json.dumps({"context": c, "completion": t}) + "\n" for c, t in rows))
    monkeypatch.setattr(backend, "beam_search", lambda *a, **k: pytest.fail("decoded before the check"))
    out = tmp_path / "beam.jsonl"
    argv = ["--backend", "torch", "--base", str(tmp_path / "base"), "--test", str(test)]
    argv += ["--vocab", str(toy["tokenizer"]), "--recipe", "toy", "--batch-size", "1", "--out", str(out)]
    argv += ["--set", "beam=2", "max_new_tokens=8"]
    capsys.readouterr()
    assert beam_cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: --test {test} line 4: its context is {len(tok.encode(long)) + 1} tokens"), err
    assert "max_new_tokens=8" in err and "n_positions=64" in err and not out.exists()


def test_beam_length_rule_is_the_decoders():
    """The check accepts exactly what the decoder runs: len(prompt) + max_new_tokens - 1 tokens
    (the last generated token is never fed back)."""
    backend = lora_core.get_backend("torch")
    cfg = lora_core.gpt2_config("tiny-32", vocab_size=40, n_positions=24, n_layer=1)
    model = backend.build_model(cfg, None, lora_core.init_gpt2_weights(cfg, 0))
    bc = BeamConfig(beam=2, max_new_tokens=5, no_repeat_ngram_size=0, stop_ids=())  # no early stop
    fits, too_long = [3] * 20, [3] * 21  # 20 + 5 - 1 == 24 positions
    beam_cli.check_prompt_lengths([fits], [1], cfg, bc.max_new_tokens, "t")
    assert len(backend.beam_search(model, [fits], bc, progress=False, decode_step="eager")[0]) == 5
    with pytest.raises(ValueError, match="^--test t line 7: its context is 21 tokens .* would reach 25 tokens"):
        beam_cli.check_prompt_lengths([fits, too_long], [1, 7], cfg, bc.max_new_tokens, "t")
    with pytest.raises(ValueError, match="sequence of 25 tokens exceeds n_positions=24"):
        backend.beam_search(model, [too_long], bc, progress=False, decode_step="eager")


# --------------------------------------------------------------------------- 4: E2E files


def test_one_mr_of_several_references_is_refused(tmp_path, toy, capsys):
    """No E2E reference file holds one MR of several references: a file of one group, with or
    without the blank line after it, is read as single references (measure_scores.py's
    ``data_ref = [[inst] for inst in data_ref[0]]``, mirrored by lora-eval). Refused before any
    file is written; one MR of one reference, or several MRs, are written and read back."""
    for text in ("r1\nr2\nr3\n", "r1\nr2\nr3\n\n"):
        assert group_e2e_references(text.splitlines())[0] == [["r1"], ["r2"], ["r3"]]
    ref, pred = tmp_path / "ref.txt", tmp_path / "pred.txt"
    with pytest.raises(ValueError, match=r"^--ref-type e2e: the test set holds a single MR \('m'\) with 2 refer"):
        write_e2e_files([ReferenceGroup("m", ["A b.", "C d."])], ["p"], ref, pred)
    assert not ref.exists() and not pred.exists()
    write_e2e_files([ReferenceGroup("m", ["A b."])], ["p"], ref, pred)
    assert read_e2e_references(ref)[0] == [["A b."]]
    write_e2e_files([ReferenceGroup("m", ["A b.", "C d."]), ReferenceGroup("n", ["E."])], ["p", "q"], ref, pred)
    assert read_e2e_references(ref)[0] == [["A b.", "C d."], ["E."]]
    # the decode command: status 1, the reason, no file
    tok = load_tokenizer(toy["tokenizer"])
    test, beams = tmp_path / "one.jsonl", tmp_path / "beam.jsonl"
    test.write_text("".join(json.dumps({"context": "name : A", "completion": t}) + "\n" for t in ("x", "y")))
    beams.write_text(json.dumps({"index": 0, "tokens": tok.encode(" x") + [tok.eos_id]}) + "\n")
    ref, pred = tmp_path / "r2.txt", tmp_path / "p2.txt"
    argv = ["--vocab", str(toy["tokenizer"]), "--beam", str(beams), "--test", str(test), "--ref-type", "e2e"]
    capsys.readouterr()
    assert decode_cli.main([*argv, "--ref-out", str(ref), "--pred-out", str(pred)]) == 1
    assert "error: --ref-type e2e: the test set holds a single MR" in capsys.readouterr().err
    assert not ref.exists() and not pred.exists()


# --------------------------------------------------------------------------- 5: demo --test-limit


def test_demo_refuses_a_negative_or_unscorable_test_limit(tmp_path, capsys, monkeypatch):
    """A negative --test-limit dropped MRs from the end (a slice's stop); 1 leaves the toy set's
    first MR, of 3 references: refused before the base is pretrained."""
    monkeypatch.setattr(demo_cli, "pretrain_base", lambda *a, **k: pytest.fail("pretrained"))
    monkeypatch.setattr(demo_cli, "pin_threads", lambda n: None)  # (no thread count left behind)
    for limit, message in (("-1", "--test-limit must be >= 0 (0: every test MR), got -1"),
                           ("1", "--test-limit 1: the test set holds a single MR")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            demo_cli.main(["--out", str(tmp_path / "demo"), "--backends", "torch", f"--test-limit={limit}"])
        assert e.value.code == 2 and message in capsys.readouterr().err


# --------------------------------------------------------------------------- 6: prepare's [SPLIT=]PATH


def test_prepare_split_arg_with_an_equals_sign_in_the_path(tmp_path, toy, monkeypatch, capsys):
    """A "/" before the "=", or the whole text an existing file: a bare PATH; else SPLIT=PATH."""
    split = prepare_cli._split_arg
    assert split("/data/a=b/test.txt") == ("test", Path("/data/a=b/test.txt"))
    assert split("x/a=b/valid_formatted.jsonl") == ("valid", Path("x/a=b/valid_formatted.jsonl"))
    assert split("train=x/a=b/t.txt") == ("train", Path("x/a=b/t.txt"))
    monkeypatch.chdir(tmp_path)
    assert split("dev=1.txt") == ("dev", Path("1.txt"))  # no such file: SPLIT=PATH
    Path("dev=1.txt").write_text("")
    assert split("dev=1.txt") == ("dev=1", Path("dev=1.txt"))  # an existing file: a bare PATH
    with pytest.raises(argparse.ArgumentTypeError):
        split("=x.txt")
    folder = tmp_path / "a=b"
    folder.mkdir()
    (folder / "test.txt").write_text(Path(toy["test"]).read_text())
    capsys.readouterr()
    argv = ["e2e", "--vocab", str(toy["tokenizer"]), "--out-dir", str(tmp_path / "o"), "--no-progress"]
    assert prepare_cli.main([*argv, str(folder / "test.txt")]) == 0
    assert (tmp_path / "o" / "test_formatted.jsonl").is_file() and (tmp_path / "o" / "test.jsonl").is_file()
