"""Sentence classification: SST-2 data (strict TSV, WordPiece vs ``transformers``' BERT
tokenizer, dynamic padding) and a 200-step LoRA fine-tune of a tiny DistilBERT in torch and
jittor with shared dropout masks (every dropout and LoRA's): loss curves agree."""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers import assert_close

import lora_core as lc
from lora_core.data import cls_data
from lora_core.lora.dropout import NumpyDropout
from lora_core.lora.layers import set_dropout_source
from lora_core.models.distilbert import PRESETS, init_weights
from lora_core.train.optim import AdamWConfig


def test_tsv_errors_name_file_and_line(tmp_path):
    p = tmp_path / "train.tsv"
    p.write_text("sentence\tlabel\ngood film \t1\nbad \t2\n")
    with pytest.raises(cls_data.DataError, match=r"train.tsv:3: label '2' is not 0 or 1"):
        cls_data.read_tsv(p)
    p.write_text("text\tlabel\ngood\t1\n")
    with pytest.raises(cls_data.DataError, match=r"train.tsv:1: expected the header"):
        cls_data.read_tsv(p)
    p.write_text("sentence\tlabel\ngood\n")
    with pytest.raises(cls_data.DataError, match=r"train.tsv:2: expected 2 tab-separated fields, got 1"):
        cls_data.read_tsv(p)
    p.write_text("sentence\tlabel\ngood\t1\n  \t0\n")
    with pytest.raises(cls_data.DataError, match=r"train.tsv:3: empty sentence"):
        cls_data.read_tsv(p)
    p.write_bytes(b"sentence\tlabel\ngood\t1\nbad \xff\t0\n")
    with pytest.raises(cls_data.DataError, match=r"train.tsv:3: not UTF-8 text \(byte 0xff\)"):
        cls_data.read_tsv(p)


def test_test_split_keeps_glue_indices(shared_dir, tmp_path, monkeypatch):
    """test.tsv's index column is GLUE's id of each sentence: kept into test.jsonl and the
    predictions file (a submission names it), checked (whole numbers, each once); --max-len < 2
    (no room for [CLS] and [SEP]) refused."""
    from examples.cls import prepare

    p = tmp_path / "test.tsv"
    p.write_text("index\tsentence\n999\ta fine film\n4\tdull\n")
    assert cls_data.read_tsv(p, labelled=False) == [("a fine film", 999), ("dull", 4)]
    for body, words in (("x\tdull\n", "index 'x' is not a whole number"), ("4\ta\n4\tb\n", "index 4 again (line 2")):
        p.write_text("index\tsentence\n" + body)
        with pytest.raises(cls_data.DataError, match=re.escape(words)):
            cls_data.read_tsv(p, labelled=False)
    (tmp_path / "train.tsv").write_text("sentence\tlabel\ngood\t1\n")
    (tmp_path / "dev.tsv").write_text("sentence\tlabel\nbad\t0\n")
    p.write_text("index\tsentence\n999\ta fine film\n4\tdull\n")
    vocab = shared_dir / "data" / "distilbert-vocab" / "vocab.txt"
    prepare.prepare(tmp_path, vocab, tmp_path / "enc")
    ids, labels, indices = prepare.read_prepared(tmp_path / "enc" / "test.jsonl", with_index=True)
    assert labels is None and indices == [999, 4] and len(ids) == 2
    assert prepare.read_prepared(tmp_path / "enc" / "dev.jsonl", with_index=True)[2] is None
    from examples.cls import evaluate

    monkeypatch.setattr(evaluate, "predict", lambda bk, model, ids: np.arange(len(ids)) % 2)
    import types

    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=64, vocab_size=30522))
    evaluate.write_predictions(None, model, tmp_path / "enc", tmp_path / "pred", {})
    assert (tmp_path / "pred" / "test_predictions.tsv").read_text() == "index\tprediction\n999\t0\n4\t1\n"
    with pytest.raises(ValueError, match="--max-len 1: a sentence takes at least 2 tokens"):
        prepare.prepare(tmp_path, vocab, tmp_path / "enc2", max_len=1)


def test_sst2_files_and_wordpiece_match_bert_tokenizer(shared_dir):
    data = shared_dir / "data"
    dev = cls_data.read_tsv(data / "sst2" / "dev.tsv")
    test = cls_data.read_tsv(data / "sst2" / "test.tsv", labelled=False)
    assert len(dev) == 872 and sum(lab for _, lab in dev) == 444 and len(test) == 1821
    tok = cls_data.wordpiece_tokenizer(data / "distilbert-vocab" / "vocab.txt")
    sentences = [s for s, _ in dev[:200]]
    ids, cut = cls_data.encode(tok, sentences, max_len=128)
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(data / "distilbert-vocab"))  # DistilBertTokenizer
    assert ids == ref(sentences)["input_ids"] and cut == 0
    batch = cls_data.collate(ids[:4], [1, 0, 1, 1])
    assert batch["input_ids"].shape == (4, max(len(s) for s in ids[:4]))
    assert (batch["attention_mask"].sum(1) == [len(s) for s in ids[:4]]).all()


def _batches(cfg, n_steps, B=8, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_steps):
        lens = rng.integers(3, 12, B)
        labels = rng.integers(0, 2, B)
        # learnable: label 1 sentences are made of words 7 and 8, label 0 of words 9 and 10
        ids = [[1, *rng.integers(9 - 2 * lab, 11 - 2 * lab, n - 2), 2] for n, lab in zip(lens, labels)]
        out.append(cls_data.collate(ids, labels.tolist()))
    return out


def _run(name, steps, base, cfg, batches, dropout: bool):
    bk = lc.get_backend(name)
    model = bk.DistilBertForSequenceClassification(cfg)
    model.load_weights(base)
    bk.inject_lora(
        model,
        lc.LoRATargetConfig(
            r=4,
            alpha=8,
            target_modules=("q_lin", "v_lin"),
            dropout=0.1 if dropout else 0.0,
            modules_to_save=("classifier",),
        ),
    )
    source = NumpyDropout(seed=11)
    set_dropout_source(model, source)
    opt = bk.AdamW(bk.trainable_parameters(model), AdamWConfig(weight_decay=0.01))
    losses = []
    for step in range(steps):
        source.reseed(step)
        losses.append(bk.cls_train_step(model, opt, [batches[step]], lr=2e-3)["loss"])
    return np.array(losses), bk.cls_predict(model, batches[0])


def test_200_steps_jittor_vs_torch_shared_dropout():
    cfg = PRESETS["tiny"]
    base = init_weights(cfg, seed=0)
    batches = _batches(cfg, 200)
    lt, pt = _run("torch", 200, base, cfg, batches, dropout=True)
    lj, pj = _run("jittor", 200, base, cfg, batches, dropout=True)
    assert_close("DistilBERT LoRA 200 steps, shared dropout: loss jittor vs torch", lj, lt, 1e-4)
    assert np.array_equal(pj, pt)
    assert lt[-20:].mean() < 0.5 * lt[:20].mean()  # it learns
    no_drop, _ = _run("torch", 20, base, cfg, batches, dropout=False)
    assert np.abs(no_drop - lt[:20]).max() > 1e-4  # the masks do act


def test_prepare_and_evaluate_peft_adapter_both_backends(shared_dir, tmp_path):
    """prepare -> evaluate with a peft adapter on a HF DistilBERT: dev accuracy and test
    predictions of both backends equal those of transformers + peft."""
    import copy

    peft = pytest.importorskip("peft")
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    from examples.cls import evaluate, prepare

    src = shared_dir / "data" / "sst2"
    (tmp_path / "sst2").mkdir()
    for split, n in (("train", 20), ("dev", 60), ("test", 30)):
        lines = (src / f"{split}.tsv").read_text(encoding="utf-8").split("\n")[: n + 1]
        (tmp_path / "sst2" / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    summary = prepare.prepare(
        tmp_path / "sst2", shared_dir / "data" / "distilbert-vocab" / "vocab.txt", tmp_path / "enc"
    )
    assert summary["dev"]["n"] == 60 and summary["test"]["n"] == 30
    torch.manual_seed(0)
    hf = tf.DistilBertForSequenceClassification(
        tf.DistilBertConfig(dim=32, n_layers=2, n_heads=2, hidden_dim=64)
    ).eval()
    with torch.no_grad():  # larger weights: the first token's state depends on the sentence
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(tmp_path / "base")
    theirs = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_lin", "v_lin"],
                                 modules_to_save=["classifier"], init_lora_weights=False)).eval()  # fmt: skip
    ids, labels = prepare.read_prepared(tmp_path / "enc" / "dev.jsonl")

    def logits():
        with torch.no_grad():
            return np.concatenate([theirs(**{k: torch.from_numpy(v) for k, v in cls_data.collate(ids[i : i + 16]).items()})
                                   .logits.numpy() for i in range(0, len(ids), 16)])  # fmt: skip

    diff = logits() @ np.array([-1.0, 1.0])
    with torch.no_grad():  # centre the classifier's decision on this data: both classes predicted
        theirs.base_model.model.classifier.modules_to_save["default"].bias[1] -= float(np.median(diff))
    theirs.save_pretrained(tmp_path / "peft")
    want = logits().argmax(-1)
    assert 0 < want.sum() < len(want)  # both classes predicted: the comparison is not trivial
    for name in ("torch", "jittor"):
        m = evaluate.evaluate(name, tmp_path / "base", tmp_path / "peft", tmp_path / "enc", tmp_path / name)
        assert m["dev_accuracy"] == cls_data.accuracy(want, labels) and m["dev_n"] == 60
        got = np.loadtxt(tmp_path / name / "dev_predictions.tsv", skiprows=1, dtype=np.int64)[:, 1]
        assert np.array_equal(got, want), name
    assert (tmp_path / "torch" / "test_predictions.tsv").read_text() == (
        tmp_path / "jittor" / "test_predictions.tsv"
    ).read_text()


def test_prepared_splits_are_checked_before_predicting(tmp_path):
    """A prepared split that holds a GLUE index twice, or nothing, or a sentence longer than the
    model's positions, is refused naming the file (and line) before anything is predicted; a
    missing or damaged vocabulary is named too (tokenizers raises a bare Exception)."""
    import json
    import types

    from examples.cls import evaluate, prepare

    test = tmp_path / "test.jsonl"
    test.write_text("".join(json.dumps({"ids": [101, 5, 102], "index": i}) + "\n" for i in (0, 1, 1)))
    with pytest.raises(cls_data.DataError, match=r"test.jsonl:3: index 1 again \(line 2 has it\)"):
        prepare.read_prepared(test, with_index=True)
    (tmp_path / "dev.jsonl").write_text("")
    with pytest.raises(cls_data.DataError, match="dev.jsonl: the file is empty"):
        prepare.read_prepared(tmp_path / "dev.jsonl")
    (tmp_path / "dev.jsonl").write_text(json.dumps({"ids": [101, 102], "label": 1}) + "\n"
                                        + json.dumps({"ids": [101] * 40, "label": 0}) + "\n")  # fmt: skip
    test.write_text(json.dumps({"ids": [101, 102], "index": 0}) + "\n")
    cfg = types.SimpleNamespace(max_position_embeddings=32, vocab_size=200)
    with pytest.raises(ValueError, match=r"dev.jsonl line 2 has 40 tokens: between 1 and the model's 32 positions"):
        evaluate.read_splits(tmp_path, cfg)
    with pytest.raises(cls_data.DataError, match="no-vocab.txt: no such vocabulary file"):
        cls_data.wordpiece_tokenizer(tmp_path / "no-vocab.txt")
    with pytest.raises(cls_data.DataError, match="not a file"):
        cls_data.wordpiece_tokenizer(tmp_path)



def test_tsv_with_only_its_header_is_refused(shared_dir, tmp_path):
    """A train/dev/test TSV with its header and no sentence would prepare an empty split: refused
    naming the file."""
    from examples.cls import prepare

    for name, header in (("train.tsv", "sentence\tlabel"), ("test.tsv", "index\tsentence")):
        (tmp_path / name).write_text(header + "\n")
        with pytest.raises(cls_data.DataError, match=rf"{name}: no sentence after the header"):
            cls_data.read_tsv(tmp_path / name, labelled=name != "test.tsv")
    (tmp_path / "train.tsv").write_text("sentence\tlabel\ngood\t1\n")
    (tmp_path / "test.tsv").write_text("index\tsentence\n0\tdull\n")
    (tmp_path / "dev.tsv").write_text("sentence\tlabel\n")
    with pytest.raises(cls_data.DataError, match=r"dev.tsv: no sentence after the header"):
        prepare.prepare(tmp_path, shared_dir / "data" / "distilbert-vocab" / "vocab.txt", tmp_path / "enc")
    assert not (tmp_path / "enc").exists()


def test_sentence_without_tokens_is_refused_naming_file_and_line(shared_dir, tmp_path):
    """A sentence of characters the tokenizer drops (a zero-width space) is not blank to
    ``str.strip`` but encodes to [CLS] [SEP] alone: refused naming file and line, before any
    split is written."""
    from examples.cls import prepare

    vocab = shared_dir / "data" / "distilbert-vocab" / "vocab.txt"
    (tmp_path / "train.tsv").write_text("sentence\tlabel\ngood\t1\n")
    (tmp_path / "test.tsv").write_text("index\tsentence\n0\tdull\n")
    (tmp_path / "dev.tsv").write_text("sentence\tlabel\nbad\t0\n\u200b\t1\n")
    assert cls_data.read_tsv(tmp_path / "dev.tsv")[1] == ("\u200b", 1)
    with pytest.raises(cls_data.DataError, match=r"dev.tsv:3: no token between \[CLS\] and \[SEP\]"):
        prepare.prepare(tmp_path, vocab, tmp_path / "enc")
    assert not (tmp_path / "enc").exists()  # train.tsv, fine, is not written before dev.tsv is checked
    with pytest.raises(cls_data.DataError, match=r"sentence 2: no token between"):  # without a file to name
        cls_data.encode(cls_data.wordpiece_tokenizer(vocab), ["fine", "\u200b\x00"], max_len=2)


def test_read_prepared_index_on_every_line_or_none(tmp_path):
    """A test split with "index" on some lines only would give the others their line number
    silently: refused naming file and line; on none (older files): 0..n-1."""
    import json

    from examples.cls import prepare

    test = tmp_path / "test.jsonl"
    a, b = {"ids": [101, 5, 102]}, {"ids": [101, 6, 102]}
    for lines in ([{**a, "index": 7}, b], [a, {**b, "index": 0}]):
        test.write_text("".join(json.dumps(r) + "\n" for r in lines))
        with pytest.raises(cls_data.DataError, match=r"test.jsonl:2: 'index' present on some lines and not on others"):
            prepare.read_prepared(test, with_index=True)
    test.write_text(json.dumps(a) + "\n" + json.dumps(b) + "\n")
    assert prepare.read_prepared(test, with_index=True)[2] == [0, 1]


def test_evaluate_refuses_an_unlabelled_dev_split(tmp_path):
    """A dev split without labels gives no accuracy: refused naming it, not skipped."""
    import json
    import types

    from examples.cls import evaluate

    cfg = types.SimpleNamespace(max_position_embeddings=32, vocab_size=200)
    (tmp_path / "dev.jsonl").write_text(json.dumps({"ids": [101, 5, 102], "index": 0}) + "\n")
    with pytest.raises(cls_data.DataError, match=r"dev.jsonl: no labels \(the dev split must be labelled\)"):
        evaluate.read_splits(tmp_path, cfg)


def test_evaluate_refuses_a_split_that_is_a_folder(tmp_path):
    """A split path that is a folder is refused naming it; only a missing split is skipped."""
    import json
    import types

    from examples.cls import evaluate

    cfg = types.SimpleNamespace(max_position_embeddings=32, vocab_size=200)
    (tmp_path / "test.jsonl").write_text(json.dumps({"ids": [101, 5, 102], "index": 3}) + "\n")
    assert list(evaluate.read_splits(tmp_path, cfg)) == [tmp_path / "test.jsonl"]  # no dev.jsonl: skipped
    (tmp_path / "dev.jsonl").mkdir()
    with pytest.raises(ValueError, match=r"dev.jsonl: a folder, not a file"):
        evaluate.read_splits(tmp_path, cfg)


def test_evaluate_removes_an_earlier_runs_predictions_of_a_split_it_does_not_predict(tmp_path, monkeypatch, capsys):
    """--out then holds this run's predictions only, as its metrics.json says."""
    import json
    import types

    from examples.cls import evaluate

    prepared, out = tmp_path / "prepared", tmp_path / "out"
    prepared.mkdir()
    out.mkdir()
    (prepared / "test.jsonl").write_text(json.dumps({"ids": [101, 5, 102], "index": 3}) + "\n")
    (out / "dev_predictions.tsv").write_text("index\tprediction\n0\t1\n")
    (out / "notes.txt").write_text("kept")
    monkeypatch.setattr(evaluate, "predict", lambda bk, model, ids: [1] * len(ids))
    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=32, vocab_size=200))
    metrics = evaluate.write_predictions(None, model, prepared, out, {})
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "notes.txt", "test_predictions.tsv"]
    assert "dev_accuracy" not in metrics and "removed" in capsys.readouterr().err
    assert (out / "test_predictions.tsv").read_text() == "index\tprediction\n3\t1\n"


def test_cls_out_options_that_are_files_are_refused_before_any_work(shared_dir, tmp_path, capsys):
    """prepare's --out-dir and evaluate's --out naming a file: one line naming the option, before
    any work (the data folder and the base here do not exist)."""
    from examples.cls import evaluate, prepare

    afile = tmp_path / "afile"
    afile.write_text("x")
    vocab = shared_dir / "data" / "distilbert-vocab" / "vocab.txt"
    assert prepare.main(["--data-dir", str(tmp_path / "none"), "--vocab", str(vocab), "--out-dir", str(afile)]) == 2
    assert capsys.readouterr().err == f"error: --out-dir {afile}: a file, not a folder\n"
    assert evaluate.main(["--base", str(tmp_path / "no-base"), "--prepared", str(tmp_path), "--out", str(afile)]) == 1
    assert capsys.readouterr().err == f"error: --out {afile}: a file, not a folder\n"
