"""Bad input to the train commands (issue 22): an empty or blank training or validation file, a
missing one or a folder in its place, an ``--out-dir`` that is a file or lies below one, a folder
holding a previous run. Each command (``examples.nlg.train``, ``examples.cls.train``) refuses it
before any model is loaded, with one line ``error: ...`` naming the option or file and the problem
(status 1, as the commands' other bad input), and leaves no run folder; the trainer itself raises
``ValueError`` on an empty training or validation set. Nothing here trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import lora_core
from examples.cls import train as cls_cli
from examples.nlg import train as nlg_cli
from lora_core.train.trainer import train

EXAMPLE = {"nlg": {"context": [1, 2, 3], "completion": [4, 5]}, "cls": {"ids": [1, 8, 2], "label": 1}}


def _write(path: Path, content: str | None) -> Path:
    """``content`` None: a folder at ``path``; else a file holding it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir() if content is None else path.write_text(content)
    return path


def _good(kind: str, n: int = 4) -> str:
    return "".join(json.dumps(EXAMPLE[kind]) + "\n" for _ in range(n))


# what stands where a data file should be, and the problem the message names (None: left out)
DATA_CASES = {
    "empty": ("", "the file is empty (no examples)"),
    "blank lines": ("\n  \n\t\n", "the file holds only blank lines (no examples)"),
    "missing": (False, "no such file"),
    "a folder": (None, "a folder, not a file"),
}


def _refused(main, argv: list[str], capsys, expected: str, tmp_path: Path) -> None:
    """``main(argv)`` ends with status 1 and the one line ``error: <expected>``; nothing appears
    under ``tmp_path`` (no run folder, no checkpoint, no base weights)."""
    before = sorted(tmp_path.rglob("*"))
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err == f"error: {expected}\n", err
    assert sorted(tmp_path.rglob("*")) == before


def _out_below(blocker: Path, where: str) -> tuple[Path, str]:
    """An ``--out-dir`` that is the file ``blocker`` or lies below it, and the refusal expected."""
    if where == "a file":
        return blocker, f"--out-dir {blocker}: a file, not a folder"
    return blocker / "run", f"--out-dir {blocker / 'run'}: {blocker} is a file, not a folder"


# --------------------------------------------------------------------------- examples.nlg.train


def _nlg_argv(train: Path, out: Path, *extra: str) -> list[str]:
    return ["--backend", "torch", "--recipe", "toy", "--train", str(train), "--random-init", "tiny",
            "--vocab-size", "64", "--max-steps", "1", "--no-progress", "--out-dir", str(out), *extra]  # fmt: skip


@pytest.mark.parametrize("option", ["--train", "--valid"])
@pytest.mark.parametrize("case", DATA_CASES)
def test_nlg_refuses_bad_data_file(option, case, tmp_path, capsys):
    content, problem = DATA_CASES[case]
    good = _write(tmp_path / "good.jsonl", _good("nlg"))
    bad = tmp_path / "bad.jsonl"
    if content is not False:
        _write(bad, content)
    train_path, extra = (bad, []) if option == "--train" else (good, ["--valid", str(bad)])
    _refused(
        nlg_cli.main, _nlg_argv(train_path, tmp_path / "out", *extra), capsys, f"{option} {bad}: {problem}", tmp_path
    )


@pytest.mark.parametrize("where", ["a file", "below a file"])
def test_nlg_refuses_out_dir_that_is_a_file(where, tmp_path, capsys):
    good = _write(tmp_path / "good.jsonl", _good("nlg"))
    blocker = _write(tmp_path / "blocker", "not a folder\n")
    out, expected = _out_below(blocker, where)
    _refused(nlg_cli.main, _nlg_argv(good, out, "--save-base"), capsys, expected, tmp_path)
    assert blocker.read_text() == "not a folder\n"


def test_nlg_refuses_previous_run_before_loading(tmp_path, capsys):
    good = _write(tmp_path / "good.jsonl", _good("nlg"))
    run = _write(tmp_path / "run" / "train_config.json", "{}").parent
    expected = f"--out-dir {run} holds a previous run: resume it (--resume) or choose a new folder"
    _refused(nlg_cli.main, _nlg_argv(good, run, "--save-base"), capsys, expected, tmp_path)  # no OUT/base


# --------------------------------------------------------------------------- examples.cls.train


def _cls_argv(prepared: Path, out: Path) -> list[str]:
    return ["--backend", "torch", "--prepared", str(prepared), "--base", str(prepared.parent / "no-base"),
            "--max-steps", "1", "--no-progress", "--out-dir", str(out)]  # fmt: skip


@pytest.mark.parametrize("split", ["train", "dev"])
@pytest.mark.parametrize("case", DATA_CASES)
def test_cls_refuses_bad_split_file(split, case, tmp_path, capsys):
    content, problem = DATA_CASES[case]
    prepared = tmp_path / "prepared"
    for name in ("train", "dev"):
        if name != split:
            _write(prepared / f"{name}.jsonl", _good("cls"))
    bad = prepared / f"{split}.jsonl"
    if content is not False:
        _write(bad, content)
    else:
        problem += " (run examples.cls.prepare first)"
    _refused(cls_cli.main, _cls_argv(prepared, tmp_path / "out"), capsys, f"{bad}: {problem}", tmp_path)


def test_cls_refuses_prepared_that_is_a_file(tmp_path, capsys):
    prepared = _write(tmp_path / "prepared", "")
    expected = f"--prepared {prepared}: a file, not a folder (the output folder of examples.cls.prepare)"
    _refused(cls_cli.main, _cls_argv(prepared, tmp_path / "out"), capsys, expected, tmp_path)


@pytest.mark.parametrize("where", ["a file", "below a file"])
def test_cls_refuses_out_dir_that_is_a_file(where, tmp_path, capsys):
    prepared = tmp_path / "prepared"
    for name in ("train", "dev"):
        _write(prepared / f"{name}.jsonl", _good("cls"))
    blocker = _write(tmp_path / "blocker", "not a folder\n")
    out, expected = _out_below(blocker, where)
    _refused(cls_cli.main, _cls_argv(prepared, out), capsys, expected, tmp_path)
    assert blocker.read_text() == "not a folder\n"


# --------------------------------------------------------------------------- the trainer


def test_trainer_refuses_empty_sets_before_its_folder(tmp_path):
    """The library call too: ValueError (not ZeroDivisionError in the loop), and no run folder."""
    bk = lora_core.get_backend("torch")
    recipe = lora_core.train.recipes.get_recipe("toy")
    cfg = lora_core.gpt2_config("tiny", vocab_size=64)
    model = bk.build_model(cfg, recipe.train.lora_config(), base=lora_core.init_gpt2_weights(cfg, 0))
    pairs = [([1, 2, 3], [4, 5])] * 4
    with pytest.raises(ValueError, match="the training set is empty: no lm example to train on"):
        train(bk, model, [], None, recipe.train, tmp_path / "a", max_steps=1, progress=False)
    with pytest.raises(ValueError, match="the validation set is empty"):
        train(bk, model, pairs, [], recipe.train, tmp_path / "b", max_steps=1, progress=False)
    _write(tmp_path / "c", "")
    with pytest.raises(ValueError, match=f"{tmp_path / 'c'}: a file, not a folder"):
        train(bk, model, pairs, None, recipe.train, tmp_path / "c", max_steps=1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


# --------------------------------------------------------------------------- beam and evaluate commands


def test_nlg_beam_refuses_a_zero_batch_and_an_empty_test_file(tmp_path, capsys):
    """``examples.nlg.beam``: ``--batch-size 0`` and a test file of no examples, one line each
    (they had ended in a ZeroDivisionError and in "wrote 0 beams")."""
    from examples.nlg import beam as beam_cli
    from lora_core.data.toy import make_toy_dataset

    toy = make_toy_dataset(tmp_path / "toy", vocab_size=256)
    empty = _write(tmp_path / "empty.jsonl", "")
    argv = ["--backend", "torch", "--base", str(tmp_path / "base"), "--test", str(empty), "--vocab", str(toy["tokenizer"]),
            "--recipe", "toy", "--out", str(tmp_path / "beam.jsonl")]  # fmt: skip
    for extra, words in ((["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
                         ([], f"--test {empty}: the file holds no examples")):
        capsys.readouterr()
        assert beam_cli.main(argv + extra) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "beam.jsonl").exists()


def test_cls_evaluate_refuses_missing_folders_in_one_line(tmp_path, capsys):
    """``examples.cls.evaluate`` with a missing ``--prepared`` folder had printed ``{}`` and exited 0;
    a missing base or adapter had ended in a traceback."""
    from examples.cls import evaluate as cls_eval

    prepared = tmp_path / "prepared"
    _write(prepared / "dev.jsonl", _good("cls"))
    base = ["--backend", "torch", "--out", str(tmp_path / "eval")]
    for argv, words in (
        (["--base", str(tmp_path), "--prepared", str(tmp_path / "none")],
         f"--prepared {tmp_path / 'none'}: holds neither dev.jsonl nor test.jsonl"),
        (["--base", str(tmp_path / "no-base"), "--prepared", str(prepared)], str(tmp_path / "no-base")),
        (["--base", str(tmp_path / "no-base"), "--adapter", str(tmp_path / "no-adapter"), "--prepared", str(prepared)],
         "no-"),
    ):  # fmt: skip
        capsys.readouterr()
        assert cls_eval.main(base + argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "eval").exists()
