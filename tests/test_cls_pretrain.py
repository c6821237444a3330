"""Masked-LM pre-training of the demo's DistilBERT base (examples/cls/pretrain.py): BERT's
masking, the MLM loss equals transformers' ``DistilBertForMaskedLM`` loss, two runs give
bit-identical weights, the output folder is written whole or not at all, it loads in both
backends with the hidden states and logits of transformers' DistilBERT, bad input is
refused with a clear message."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import assert_close, to_numpy

from lora_core.data import cls_data
from lora_core.data.nlg import DataFormatError, write_jsonl_atomic

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
from examples.cls import pretrain  # noqa: E402

TINY = dict(dim=16, n_layers=2, n_heads=2, hidden_dim=32, steps=6, batch_size=8, lr=1e-3, warmup=2, max_len=64,
            log_every=2, progress=False)  # fmt: skip


@pytest.fixture(scope="module")
def sentences(shared_dir):
    """The first 64 SST-2 dev sentences, WordPiece ids ([CLS] ... [SEP])."""
    data = shared_dir / "data"
    rows = cls_data.read_tsv(data / "sst2" / "dev.tsv")[:64]
    ids, cut = cls_data.encode(cls_data.wordpiece_tokenizer(data / "distilbert-vocab" / "vocab.txt"),
                               [s for s, _ in rows], max_len=64)  # fmt: skip
    assert cut == 0
    return ids


@pytest.fixture(scope="module")
def base(sentences, tmp_path_factory):
    return pretrain.pretrain_mlm(sentences, tmp_path_factory.mktemp("mlm") / "base", **TINY)


def _weights(folder):
    from safetensors.numpy import load_file

    return load_file(folder / "model.safetensors")


def test_mask_tokens_bert_rule():
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 30000, (400, 50))
    ids[:, 0], ids[:, -1], ids[:200, 40:] = pretrain.CLS_ID, pretrain.SEP_ID, pretrain.PAD_ID
    inputs, labels = pretrain.mask_tokens(ids, np.random.default_rng(1))
    sel = labels != -100
    candidate = (ids != pretrain.CLS_ID) & (ids != pretrain.SEP_ID) & (ids != pretrain.PAD_ID)
    assert not (sel & ~candidate).any() and (labels[sel] == ids[sel]).all()
    assert (inputs[~sel] == ids[~sel]).all()
    assert abs(sel.sum() / candidate.sum() - 0.15) < 0.01
    masked, kept = (inputs[sel] == pretrain.MASK_ID).mean(), (inputs[sel] == ids[sel]).mean()
    assert abs(masked - 0.8) < 0.02 and abs(kept - 0.1) < 0.02 and abs(1 - masked - kept - 0.1) < 0.02
    again = pretrain.mask_tokens(ids, np.random.default_rng(1))
    assert np.array_equal(again[0], inputs) and np.array_equal(again[1], labels)
    # a batch too small for 15% still predicts one token
    _, one = pretrain.mask_tokens(np.array([[101, 2000, 102]]), np.random.default_rng(0), mask_prob=1e-9)
    assert (one != -100).sum() == 1 and one[0, 1] == 2000


def test_unigram_log_prior():
    prior = pretrain.unigram_log_prior([[101, 7, 7, 9, 102], [101, 7, 102, 0]], vocab_size=110, smoothing=0.5)
    p = np.exp(prior.astype(np.float64))
    assert prior.shape == (110,) and abs(p.sum() - 1) < 1e-6 and p.argmax() == 7
    assert np.allclose(p[[7, 9, 1]], np.array([3.5, 1.5, 0.5]) / 59.0)  # (count + 0.5) / (4 + 110 x 0.5)
    assert p[101] == p[102] == p[0] == p[1]  # special tokens are never predicted: counted 0


def test_mlm_loss_equals_transformers_loss(sentences):
    torch.manual_seed(0)
    model = tf.DistilBertForMaskedLM(tf.DistilBertConfig(dim=16, n_layers=2, n_heads=2, hidden_dim=32)).eval()
    batch = cls_data.collate(sentences[:8])
    inputs, labels = pretrain.mask_tokens(batch["input_ids"], np.random.default_rng(0))
    args = [torch.from_numpy(a) for a in (inputs, batch["attention_mask"], labels)]
    with torch.no_grad():
        ours, correct, n = pretrain.mlm_loss(model, *args)
        ref = model(input_ids=args[0], attention_mask=args[1], labels=args[2])
    assert_close("MLM loss on masked positions vs DistilBertForMaskedLM loss", ours, ref.loss, 1e-6)
    sel = labels != -100
    assert n == sel.sum() and correct == int((ref.logits.argmax(-1).numpy()[sel] == labels[sel]).sum())


def test_two_runs_identical_and_folder_complete(sentences, base, tmp_path):
    threads, rng_state = torch.get_num_threads(), torch.get_rng_state()
    again = pretrain.pretrain_mlm(sentences, tmp_path / "again", **TINY)
    assert torch.get_num_threads() == threads and torch.equal(torch.get_rng_state(), rng_state)  # left as found
    assert sorted(p.name for p in base.iterdir()) == ["config.json", "log.jsonl", "model.safetensors", "pretrain.json"]
    a, b = _weights(base), _weights(again)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert (base / "log.jsonl").read_text() == (again / "log.jsonl").read_text()
    log = [json.loads(line) for line in (base / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4, 6] and set(log[0]) == {"step", "loss", "lr", "masked_accuracy"}
    cfg = json.loads((base / "config.json").read_text())
    assert cfg["architectures"] == ["DistilBertForMaskedLM"] and cfg["vocab_size"] == 30522 and cfg["dim"] == 16
    assert cfg["dropout"] == cfg["attention_dropout"] == 0.1  # fine-tuning's; pre-trained without
    assert json.loads((base / "pretrain.json").read_text())["settings"]["dropout"] == 0.0
    other = _weights(pretrain.pretrain_mlm(sentences, tmp_path / "seed1", **dict(TINY, seed=1)))
    assert not np.array_equal(other["vocab_transform.weight"], a["vocab_transform.weight"])  # the seed matters
    init = tf.DistilBertForMaskedLM(tf.DistilBertConfig(dim=16, n_layers=2, n_heads=2, hidden_dim=32))
    assert not np.allclose(a["vocab_transform.weight"], init.vocab_transform.weight.detach().numpy())  # it trained


def test_output_is_atomic(sentences, tmp_path, monkeypatch):
    out = tmp_path / "runs" / "base"
    calls = []

    def dies(*a, **k):  # killed after 3 updates
        calls.append(1)
        if len(calls) > 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    real = pretrain.mask_tokens
    monkeypatch.setattr(pretrain, "mask_tokens", dies)
    with pytest.raises(KeyboardInterrupt):
        pretrain.pretrain_mlm(sentences, out, **TINY)
    assert list((tmp_path / "runs").iterdir()) == []  # no half folder, no temp folder left
    monkeypatch.setattr(pretrain, "mask_tokens", real)
    pretrain.pretrain_mlm(sentences, out, **dict(TINY, steps=3))
    with pytest.raises(FileExistsError, match="base: exists and is not empty"):
        pretrain.pretrain_mlm(sentences, out, **TINY)
    before = _weights(out)
    calls.clear()
    monkeypatch.setattr(pretrain, "mask_tokens", dies)
    with pytest.raises(KeyboardInterrupt):
        pretrain.pretrain_mlm(sentences, out, overwrite=True, **TINY)
    after = _weights(out)  # the old folder is untouched
    assert all(np.array_equal(before[k], after[k]) for k in before) and len(list((tmp_path / "runs").iterdir())) == 1


def _batch(sentences):
    return cls_data.collate(sentences[10:14])  # 4 lengths: right padding


def _hf_classifier(base, head):
    hf = tf.DistilBertForSequenceClassification.from_pretrained(base, num_labels=2).eval()
    with torch.no_grad():
        for name, value in head.items():
            hf.get_parameter(name).copy_(torch.from_numpy(value))
    return hf


def test_loads_in_backend_with_transformers_outputs(backend, base, sentences):
    batch = _batch(sentences)
    assert batch["attention_mask"].min() == 0  # padding is exercised
    ours = backend.distilbert_from_pretrained(base, num_labels=2)
    rng = np.random.default_rng(0)  # a head with O(1) logits (the new head's 0.02 makes them tiny)
    head = {n: rng.normal(0, 0.3, v.shape).astype(np.float32) for n, v in ours.state_numpy().items()
            if "classifier" in n}  # fmt: skip
    assert len(head) == 4
    ours.load_weights(dict(ours.state_numpy(), **head))
    ours.eval()
    hf = _hf_classifier(base, head)
    ids, mask = (batch["input_ids"], batch["attention_mask"])
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits
    if backend.NAME == "torch":
        got = ours(torch.from_numpy(ids), torch.from_numpy(mask))
        hidden = ours.distilbert(torch.from_numpy(ids), torch.from_numpy(mask))
        hf_model = tf.DistilBertModel.from_pretrained(base).eval()
        with torch.no_grad():
            ref_hidden = hf_model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
        real = mask.astype(bool)
        assert_close("pre-trained base: torch hidden states vs transformers DistilBertModel",
                     to_numpy(hidden)[real], to_numpy(ref_hidden.last_hidden_state)[real], 1e-5)  # fmt: skip
    else:
        import jittor as jt

        got = ours(jt.array(ids), jt.array(mask))
    assert_close(f"pre-trained base: {backend.NAME} logits vs transformers", got, ref, 1e-5)
    assert np.abs(to_numpy(ref)).max() > 0.1


def test_bad_input(sentences, tmp_path, capsys):
    run = pretrain.pretrain_mlm
    for kw, msg in [
        (dict(steps=0), r"steps must be an int >= 1, got 0"),
        (dict(dim=18, n_heads=4), r"dim=18 is not divisible by n_heads=4"),
        (dict(warmup=6), r"warmup must be an int in \[0, steps=6\)"),
        (dict(lr=0.0), r"lr must be > 0"),
        (dict(max_len=20), r"sentence \d+: \d+ tokens > max_len=20"),
        (dict(vocab_size=2000), r"sentence \d+: token id \d+ outside \[0, 2000\)"),
    ]:
        with pytest.raises(ValueError, match=msg):
            run(sentences, tmp_path / "x", **dict(TINY, **kw))
    with pytest.raises(ValueError, match="no training sentences"):
        run([], tmp_path / "x", **TINY)
    with pytest.raises(ValueError, match=r"sentence 1: 2 tokens"):
        run([[101, 7, 102], [101, 102]], tmp_path / "x", **TINY)
    assert not (tmp_path / "x").exists()
    # the command line: a missing file, a bad line, bad settings
    cli = ["--out-dir", str(tmp_path / "cli"), "--no-progress", "--dim", "16", "--hidden-dim", "32", "--steps", "2",
           "--batch-size", "4", "--warmup", "0", "--log-every", "1", "--max-len", "64"]  # fmt: skip
    assert pretrain.main(["--prepared", str(tmp_path / "nowhere"), *cli]) == 2
    assert "nowhere/train.jsonl: no such file (run examples.cls.prepare first)" in capsys.readouterr().err
    bad = [{"ids": s, "label": 1} for s in sentences[:8]] + [{"ids": [101, -3, 102]}]
    write_jsonl_atomic(tmp_path / "p" / "train.jsonl", bad)
    assert pretrain.main(["--prepared", str(tmp_path / "p"), *cli]) == 2
    assert "train.jsonl, line 9: token id -3 outside [0, 30522)" in capsys.readouterr().err
    with pytest.raises(DataFormatError, match=r"line 2: no 'ids' field"):
        write_jsonl_atomic(tmp_path / "q" / "train.jsonl", [{"ids": [101, 7, 102]}, {"label": 1}])
        pretrain.read_train_ids(tmp_path / "q" / "train.jsonl")
    write_jsonl_atomic(tmp_path / "p" / "train.jsonl", [{"ids": s, "label": 1} for s in sentences[:8]])
    assert pretrain.main(["--prepared", str(tmp_path / "p"), *cli, "--steps", "0"]) == 2
    assert "steps must be an int >= 1, got 0" in capsys.readouterr().err
    assert pretrain.main(["--prepared", str(tmp_path / "p"), *cli, "--warmup", "5"]) == 2
    assert "--warmup must be in [0, --steps=2), got 5" in capsys.readouterr().err
    assert pretrain.main(["--prepared", str(tmp_path / "p"), *cli]) == 0
    assert "2 steps" in capsys.readouterr().out and (tmp_path / "cli" / "model.safetensors").is_file()
    # without --warmup a tenth of --steps (the default 320 would not fit 2 steps)
    no_warmup = [a for a in cli if a not in ("--warmup", "0")]
    no_warmup[no_warmup.index("--out-dir") + 1] = str(tmp_path / "cli2")
    assert pretrain.main(["--prepared", str(tmp_path / "p"), *no_warmup]) == 0
