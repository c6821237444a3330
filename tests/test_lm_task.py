"""The causal-LM text task (``examples.lm``): packing without losing or repeating a token,
strict text reading, ``prepare`` -> ``train`` on a random tiny Llama in both backends (the
same loss curve), resume after a kill, and bad input refused with the file named."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from lora_core.data.text import check_tokenizer_fits, pack_blocks, read_documents
from lora_core.data.toy import make_toy_dataset
from lora_core.train import allocator


def test_pack_blocks_keeps_every_token_once_in_order():
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50, n).tolist() for n in (7, 1, 30, 12)]
    for size in (3, 4, 8, 16, 52, 53, 100):
        blocks = pack_blocks(docs, size, eos_id=99)
        stream = [t for d in docs for t in (*d, 99)]
        assert [t for b in blocks for t in b] == stream
        assert all(len(b) == size for b in blocks[:-2]) and all(2 <= len(b) <= size for b in blocks)
        assert sum(b.count(99) for b in blocks) == len(docs)  # one boundary mark per document
    # a remainder of one token (it would predict nothing alone) takes the last token of the block
    # before it: no block longer than block_size (the model reads block_size - 1 positions)
    assert pack_blocks([[1, 2, 3, 4, 5]], 4, None) == [[1, 2, 3], [4, 5]]
    assert [len(b) for b in pack_blocks([list(range(130))], 129, None)] == [128, 2]
    with pytest.raises(ValueError, match="nothing to predict"):
        pack_blocks([[1]], 4, None)
    for size in (1, 2):
        with pytest.raises(ValueError, match="--block-size must be an int >= 3"):
            pack_blocks([[1, 2, 3]], size, None)


def test_end_of_text_in_a_document_is_refused(tmp_path):
    """The tokenizer encodes the end-of-text token's text as the token, the packing's document
    boundary: a document holding it is refused naming its file and line."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from lora_core.data.text import tokenize_documents
    from lora_core.data.tokenizer import Tokenizer

    backend = HFTokenizer(models.WordLevel({"a": 0, "<|endoftext|>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok = Tokenizer(backend, "<|endoftext|>")
    assert tokenize_documents(tok, [("x.txt", "a")]) == [[0]]
    with pytest.raises(ValueError, match=r"y.txt: line 2: holds the end-of-text token's text '<\|endoftext\|>'"):
        tokenize_documents(tok, [("x.txt", "a"), ("y.txt", "a\nb <|endoftext|> c")])


def test_read_documents_names_file_and_line(tmp_path):
    good = tmp_path / "a.txt"
    good.write_text("one\ntwo\n")
    bad = tmp_path / "b.txt"
    bad.write_bytes(b"fine line\nsecond \xff line\n")
    empty = tmp_path / "c.txt"
    empty.write_text(" \n\n")
    assert read_documents([good])[0][1] == "one\ntwo\n"
    with pytest.raises(ValueError, match=r"b.txt: line 2, column 8: not UTF-8"):
        read_documents([good, bad])
    with pytest.raises(ValueError, match="c.txt: empty file"):
        read_documents([empty])
    with pytest.raises(ValueError, match="nope.txt: no such file"):
        read_documents([tmp_path / "nope.txt"])
    with pytest.raises(ValueError, match="vocabulary has 100: not this model's tokenizer"):
        check_tokenizer_fits(512, 100)


def _run(module, *args, ok=True, env=None):
    """``python -m module args`` under ``sh``: a child killed by a signal (``--stop-after``) then
    exits through the shell (128 + N), and jittor, once imported in this process, does not
    quit pytest on its SIGCHLD."""
    cmd = ["sh", "-c", '"$@"; exit $?', "sh", sys.executable, "-m", module, *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if ok:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm")
    toy = make_toy_dataset(root / "toy", vocab_size=256)
    # the references of the toy set as plain text: two documents for training, one held out
    texts = {}
    for split in ("train", "valid"):
        lines = [ln.split("||", 1)[1] for ln in toy[split].read_text().splitlines() if "||" in ln]
        texts[split] = lines
    (root / "a.txt").write_text("\n".join(texts["train"][:40]) + "\n")
    (root / "b.txt").write_text("\n".join(texts["train"][40:80]) + "\n")
    (root / "v.txt").write_text("\n".join(texts["valid"][:20]) + "\n")
    out = root / "prepared"
    _run("examples.lm.prepare", "--tokenizer", toy["tokenizer"], "--train", root / "a.txt", root / "b.txt",
         "--valid", root / "v.txt", "--block-size", 32, "--out-dir", out)
    return root, out


def test_prepare_writes_blocks_and_meta(prepared):
    _, out = prepared
    meta = json.loads((out / "meta.json").read_text())
    blocks = [json.loads(ln)["ids"] for ln in (out / "train.jsonl").read_text().splitlines()]
    assert meta["vocab_size"] in (256, 257) and meta["block_size"] == 32 and meta["train_blocks"] == len(blocks)
    assert sum(map(len, blocks)) == meta["train_tokens"] and all(len(b) == 32 for b in blocks[:-2])
    assert sum(b.count(meta["eos_id"]) for b in blocks) == 2  # two documents


def test_prepare_holds_out_a_fraction_or_says_why_not(prepared, tmp_path, capsys):
    """Without ``--valid`` the last blocks are held out; a fraction that leaves nothing to train on
    names the option; a missing tokenizer path is said to be missing (not tried on the hub)."""
    from examples.lm import prepare as lm_prepare

    root, out = prepared
    tok = json.loads((out / "meta.json").read_text())["tokenizer"]
    args = ["--tokenizer", tok, "--train", str(root / "a.txt"), str(root / "b.txt"), "--block-size", "32"]
    assert lm_prepare.main(args + ["--valid-fraction", "0.25", "--out-dir", str(tmp_path / "q")]) == 0
    meta = json.loads((tmp_path / "q" / "meta.json").read_text())
    n = meta["train_blocks"] + meta["valid_blocks"]
    assert meta["valid_blocks"] == round(n * 0.25) and meta["valid_files"] is None
    capsys.readouterr()
    assert lm_prepare.main(args + ["--valid-fraction", "0.999", "--out-dir", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert f"--valid-fraction 0.999 of {n} training blocks holds out {n}, leaving none to train on" in err, err
    (tmp_path / "blank.txt").write_text("  \n")
    assert lm_prepare.main(args + ["--valid", str(tmp_path / "blank.txt"), "--out-dir", str(tmp_path / "t")]) == 1
    assert f"{tmp_path / 'blank.txt'}: empty file (no text to validate on)" in capsys.readouterr().err
    args[1] = str(tmp_path / "no-tokenizer")
    assert lm_prepare.main(args + ["--out-dir", str(tmp_path / "s")]) == 1
    assert f"{tmp_path / 'no-tokenizer'}: no such tokenizer file or folder" in capsys.readouterr().err
    assert not (tmp_path / "r").exists() and not (tmp_path / "s").exists()
    # a damaged tokenizer.json, an --out-dir below a file, --valid-fraction beside --valid: one line each
    (tmp_path / "tokenizer.json").write_text('{"bad": ')
    args[1] = str(tmp_path / "tokenizer.json")
    assert lm_prepare.main(args + ["--out-dir", str(tmp_path / "u")]) == 1
    assert f"{tmp_path / 'tokenizer.json'}: not a tokenizers tokenizer.json" in capsys.readouterr().err
    args[1] = tok
    (tmp_path / "afile").write_text("x")
    for extra, words in ((["--out-dir", str(tmp_path / "afile" / "sub")], f"{tmp_path / 'afile'} is a file, not a folder"),
                         (["--valid", str(root / "v.txt"), "--valid-fraction", "7", "--out-dir", str(tmp_path / "w")],
                          "--valid-fraction holds out training blocks when there is no --valid")):  # fmt: skip
        with pytest.raises(SystemExit):
            lm_prepare.main(args + extra)
        assert words in capsys.readouterr().err


def _vocab(out):
    return json.loads((out / "meta.json").read_text())["vocab_size"]


def _train(backend, root, out, name, *extra, ok=True, env=None):
    return _run("examples.lm.train", "--backend", backend, "--recipe", "lm-demo", "--prepared", out,
                "--random-init", "tiny-llama", "--vocab-size", _vocab(out), "--out-dir", root / name, "--no-progress",
                "--max-steps", 6, "--set", "train.eval_every=3", "train.save_every=3", "train.log_every=1", *extra, ok=ok, env=env)


def _losses(run_dir):
    return [r["loss"] for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines()) if "loss" in r]


def test_train_both_backends_same_curve_and_exact_resume(prepared):
    root, out = prepared
    saved = _train("torch", root, out, "torch", "--save-base")
    unsaved = _train("jittor", root, out, "jittor")
    assert "base was not written" not in saved.stdout and "--random-init base was not written" in unsaved.stdout
    lt, lj = _losses(root / "torch"), _losses(root / "jittor")
    assert len(lt) == 6 and len(lj) == 6
    assert np.abs(np.array(lj) - lt).max() <= 1e-5 * max(map(abs, lt))
    assert (root / "torch" / "ckpt-6").is_dir()
    # the random base names the prepared tokenizer's end-of-text token (generate checks it)
    base_cfg = json.loads((root / "torch" / "base" / "config.json").read_text())
    assert base_cfg["eos_token_id"] == json.loads((out / "meta.json").read_text())["eos_id"]
    # killed after update 4, resumed: the same losses as the uninterrupted run
    r = _train("torch", root, out, "killed", "--stop-after", 4, ok=False)
    assert r.returncode == 128 + 9, r.stderr
    _train("torch", root, out, "killed", "--resume")
    assert _losses(root / "killed")[-2:] == lt[-2:]


@pytest.mark.skipif(allocator.find_tcmalloc() is None, reason="tcmalloc not installed (apt-get install libtcmalloc-minimal4)")
def test_train_under_tcmalloc_gives_glibcs_losses(prepared):
    """The torch Llama run re-executes itself under tcmalloc (``lora_core.train.allocator``) and
    trains the same, bit for bit, as under glibc's malloc (where it trims the heap: GC)."""
    root, out = prepared
    runs = {}
    for mode in ("auto", "glibc"):
        env = {k: v for k, v in os.environ.items() if k not in (allocator.RELAUNCHED, "LD_PRELOAD")}
        r = _train("torch", root, out, f"alloc-{mode}", "--grad-checkpoint", env=dict(env, LORA_ALLOCATOR=mode))
        assert f"malloc: {'tcmalloc' if mode == 'auto' else 'glibc'}" in r.stderr, r.stderr
        runs[mode] = _losses(root / f"alloc-{mode}")
    assert len(runs["auto"]) == 6 and runs["auto"] == runs["glibc"]
    r = _train("torch", root, out, "alloc-bad", env=dict(os.environ, LORA_ALLOCATOR="jemalloc"), ok=False)
    assert r.returncode == 2 and "LORA_ALLOCATOR='jemalloc': expected one of auto, glibc, tcmalloc" in r.stderr, r.stderr


def test_train_refuses_mismatched_tokenizer_and_long_blocks(prepared):
    root, out = prepared
    r = _run("examples.lm.train", "--backend", "torch", "--recipe", "lm-demo", "--prepared", out, "--random-init",
             "tiny-llama", "--vocab-size", 100, "--out-dir", root / "small-vocab", ok=False)
    assert r.returncode == 1 and "meta.json: the tokenizer" in r.stderr and "not this model's tokenizer" in r.stderr
    assert not (root / "small-vocab" / "latest").exists()
    long = root / "long"
    _run("examples.lm.prepare", "--tokenizer", json.loads((out / "meta.json").read_text())["tokenizer"],
         "--train", root / "a.txt", "--valid", root / "v.txt", "--block-size", 200, "--out-dir", long)
    r = _run("examples.lm.train", "--backend", "torch", "--recipe", "lm-demo", "--prepared", long, "--random-init",
             "tiny-llama", "--vocab-size", _vocab(out), "--set", "train.batch_size=2", "--out-dir", root / "too-long", ok=False)
    assert r.returncode == 1 and "exceed the model's 128 positions" in r.stderr


def test_evaluate_and_generate_after_training(prepared):
    """The trained adapter on its saved base: the same perplexity in both backends as the
    trainer's last validation, and the same greedy continuation."""
    root, out = prepared
    run = root / "torch"
    if not (run / "ckpt-6").is_dir():
        _train("torch", root, out, "torch", "--save-base")
    last = [json.loads(ln) for ln in (run / "log.jsonl").read_text().splitlines() if "valid_nll" in ln][-1]
    res = {}
    for be in ("torch", "jittor"):
        r = _run("examples.lm.evaluate", "--backend", be, "--base", run / "base", "--adapter", run, "--prepared", out,
                 "--json", root / f"eval-{be}.json")
        res[be] = json.loads((root / f"eval-{be}.json").read_text())
        assert "perplexity" in r.stdout
    assert abs(res["torch"]["nll"] - last["valid_nll"]) <= 1e-5 * last["valid_nll"]
    assert abs(res["jittor"]["nll"] - res["torch"]["nll"]) <= 1e-5 * res["torch"]["nll"]
    tok = json.loads((out / "meta.json").read_text())["tokenizer"]
    gen = {be: _run("examples.lm.generate", "--backend", be, "--base", run / "base", "--adapter", run / "ckpt-6",
                    "--tokenizer", tok, "--prompt", "The restaurant", "--prompt", "It is",
                    "--max-new-tokens", 8).stdout for be in ("torch", "jittor")}
    assert gen["torch"] == gen["jittor"] and gen["torch"].startswith("The restaurant")


def test_train_refuses_bad_folders_and_files_in_one_line(prepared, tmp_path, capsys):
    """As the other train commands (tests/test_train_bad_input.py): one ``error:`` line naming
    the file, exit 1, nothing created."""
    import shutil

    from examples.lm import train as lm_train

    root, out = prepared
    a_file = tmp_path / "file"
    a_file.write_text("x")
    empty = tmp_path / "empty"
    shutil.copytree(out, empty)
    (empty / "train.jsonl").write_text("")
    bools, no_vocab = tmp_path / "bools", tmp_path / "no_vocab"  # JSON true/false are not token ids
    shutil.copytree(out, bools)
    (bools / "train.jsonl").write_text('{"ids": [true, false, true, 7, 9]}\n')
    shutil.copytree(out, no_vocab)
    (no_vocab / "meta.json").write_text("{}")
    base = ["--recipe", "lm-demo", "--random-init", "tiny-llama", "--vocab-size", str(_vocab(out)), "--no-progress"]
    for argv, words in (
        (["--prepared", str(out), "--out-dir", str(a_file)], f"--out-dir {a_file}: a file, not a folder"),
        (["--prepared", str(empty), "--out-dir", str(tmp_path / "r1")], f"{empty / 'train.jsonl'}: the file is empty"),
        (["--prepared", str(a_file), "--out-dir", str(tmp_path / "r2")], f"--prepared {a_file}: a file, not a folder"),
        (["--prepared", str(bools), "--out-dir", str(tmp_path / "r4")], f"{bools / 'train.jsonl'}: line 1: 'ids' must"),
        (["--prepared", str(no_vocab), "--out-dir", str(tmp_path / "r5")], f"{no_vocab / 'meta.json'}: no 'vocab_size'"),
    ):
        assert lm_train.main(base + argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()
    # a --random-init preset whose vocabulary the tokenizer outgrows: the option that fixes it
    argv = ["--recipe", "lm-demo", "--random-init", "tiny-llama", "--no-progress", "--prepared", str(out),
            "--out-dir", str(tmp_path / "r3")]  # fmt: skip
    assert _vocab(out) > 128  # tiny-llama's vocabulary
    assert lm_train.main(argv) == 1
    assert f"(a --random-init model: give --vocab-size {_vocab(out)})" in capsys.readouterr().err


def test_evaluate_and_generate_refuse_bad_options_in_one_line(prepared, tmp_path, capsys):
    """Options and files of ``examples.lm.evaluate``/``generate`` that cannot work: one ``error:``
    line naming the option or file, exit 1, before any model is built where they can be checked
    before; a prompt that with ``--max-new-tokens`` outgrows the positions, before generating."""
    from examples.lm import evaluate as lm_eval
    from examples.lm import generate as lm_gen

    root, out = prepared
    run = root / "torch"
    if not (run / "ckpt-6").is_dir():
        _train("torch", root, out, "torch", "--save-base")
    tok = json.loads((out / "meta.json").read_text())["tokenizer"]
    bad, empty = tmp_path / "bad.txt", tmp_path / "empty.txt"
    bad.write_bytes(b"The restaurant\nis \xff good\n")
    empty.write_text("\n  \n")
    ev = ["--backend", "torch", "--base", str(run / "base"), "--adapter", str(run), "--prepared", str(out)]
    gen = ["--backend", "torch", "--base", str(run / "base"), "--adapter", str(run / "ckpt-6"), "--tokenizer", str(tok)]
    for main, argv, words in (
        (lm_eval.main, ev + ["--batch-size", "-2"], "--batch-size must be >= 1, got -2"),
        (lm_eval.main, ev + ["--json", str(tmp_path)], f"--json {tmp_path}: is a folder"),
        (lm_gen.main, gen + ["--prompt", "It is", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (lm_gen.main, gen + ["--prompt", "It is", "--beam", "0"], "--beam must be >= 1, got 0"),
        (lm_gen.main, gen + ["--prompts-file", str(bad)], f"{bad}: line 2, column 4: not UTF-8 text (byte 0xff)"),
        (lm_gen.main, gen + ["--prompts-file", str(empty)], f"{empty}: empty file (no prompts)"),
        (lm_gen.main, gen + ["--prompt", "It is", "--max-new-tokens", "200"],
         "+ --max-new-tokens 200 exceeds the model's 128 positions"),
        (lm_gen.main, gen + ["--prompt", "It is " * 200], "leaves no room in the model's 128 positions: shorten it"),
        (lm_eval.main, ev + ["--json", str(bad / "x.json")], f"--json {bad / 'x.json'}: {bad} is a file, not a folder"),
    ):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and words in err, err


@pytest.mark.gpu
def test_cuda_train_evaluate_generate_match_the_cpu(prepared):
    """On a GPU (torch), the commands with ``--device cuda`` against the same with ``--device
    cpu``: the training loss curve (LoRA, and QLoRA on bitsandbytes' CUDA kernels) within 1e-4
    relative, the evaluation's perplexity too, and the same greedy and 3-beam continuations (on
    the GPU through the captured decode step, its default there)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    root, out = prepared
    curves, nll, text = {}, {}, {}
    for dev in ("cpu", "cuda"):
        _train("torch", root, out, f"dev-{dev}", "--device", dev, "--save-base")
        _train("torch", root, out, f"dev-{dev}-nf4", "--device", dev, "--quantize", "nf4")
        curves[dev] = (_losses(root / f"dev-{dev}"), _losses(root / f"dev-{dev}-nf4"))
        run = root / f"dev-{dev}"
        _run("examples.lm.evaluate", "--backend", "torch", "--base", run / "base", "--adapter", run, "--prepared", out,
             "--device", dev, "--json", root / f"eval-{dev}.json")
        nll[dev] = json.loads((root / f"eval-{dev}.json").read_text())["nll"]
        tok = json.loads((out / "meta.json").read_text())["tokenizer"]
        text[dev] = [_run("examples.lm.generate", "--backend", "torch", "--base", run / "base", "--adapter", run / "ckpt-6",
                          "--tokenizer", tok, "--prompt", "The restaurant", "--prompt", "It is", "--max-new-tokens", 8,
                          "--beam", beam, "--device", dev).stdout for beam in (1, 3)]
    for cpu, gpu in zip(curves["cpu"], curves["cuda"]):
        assert len(gpu) == len(cpu) == 6 and np.abs(np.array(gpu) - cpu).max() <= 1e-4 * max(map(abs, cpu)), (cpu, gpu)
    assert abs(nll["cuda"] - nll["cpu"]) <= 1e-4 * nll["cpu"]
    assert text["cuda"] == text["cpu"] and text["cpu"][0].startswith("The restaurant")


def test_generated_text_keeps_the_word_boundary_at_the_prompt(tmp_path):
    """A SentencePiece-style decoder (Llama 2, Mistral: Metaspace) drops a text's first leading
    space: the continuation is the prompt and the new tokens decoded together, less the prompt's
    text, so its first word is not glued to the prompt; byte-level BPE (GPT-2) gives the same
    either way."""
    import tokenizers
    from tokenizers import decoders
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Metaspace

    from examples.lm.generate import continuation
    from lora_core.data.tokenizer import load_tokenizer

    words = ["<unk>", "<s>", "</s>"] + [f"\u2581w{i}" for i in range(3, 20)]
    tk = tokenizers.Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = Metaspace(replacement="\u2581", prepend_scheme="first")
    tk.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    tk.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path, eos_token="</s>")
    ctx = tok.encode("w5 w7")
    assert tok.decode([9, 10]) == "w9 w10"  # decoded alone: no leading space
    assert "w5 w7" + continuation(tok, ctx, [9, 10]) == "w5 w7 w9 w10"


@pytest.mark.parametrize("option, words", [(["--save-base"], "--save-base applies to --random-init only"),
                                           (["--init-seed", "7"], "--init-seed applies to --random-init only"),
                                           (["--vocab-size", "300"], "--vocab-size applies to --random-init only")])
def test_random_init_options_refused_with_a_checkpoint(option, words, tmp_path, capsys):
    """``--save-base``, ``--init-seed`` and ``--vocab-size`` act on a ``--random-init`` base only:
    with ``--init-checkpoint`` each is refused in one line (the first two were accepted and
    ignored: no OUT/base written, the seed unused), before anything is read or written."""
    from examples.lm import train as lm_train

    with pytest.raises(SystemExit) as e:
        lm_train.main(["--recipe", "lm-demo", "--prepared", str(tmp_path / "p"), "--init-checkpoint",
                       str(tmp_path / "ckpt"), "--out-dir", str(tmp_path / "run"), *option])  # fmt: skip
    assert e.value.code == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_another_models_tokenizer_is_refused():
    """Another model's tokenizer: more ids than the embedding has rows, far fewer (a padded
    vocabulary adds a few percent, not 36%: a Llama 2 tokenizer on GPT-2), or an end-of-text id
    the model's config does not name (GPT-2's tokenizer on Llama 3)."""
    from types import SimpleNamespace

    from lora_core.data.text import model_eos_ids

    check_tokenizer_fits(151665, 151936, eos_id=151643, model_eos=(151643,))  # Qwen2.5: 271 padded rows
    check_tokenizer_fits(128256, 128256, eos_id=128009, model_eos=(128001, 128008, 128009))  # Llama 3 instruct
    check_tokenizer_fits(50257, 50257, eos_id=50256, model_eos=None)  # GPT-2: its config keeps no eos here
    with pytest.raises(ValueError, match=r"has 32000 tokens but the model's vocabulary has 50257 \(18257 rows no "):
        check_tokenizer_fits(32000, 50257)
    with pytest.raises(ValueError, match="ends a text with token id 50256 but the model's config names eos_token_id "
                                         "128001: not this model's tokenizer"):
        check_tokenizer_fits(128000, 128256, eos_id=50256, model_eos=(128001,))
    with pytest.raises(ValueError, match=r"eos_token_id \[1, 2\]: not this model's tokenizer \(fix\)"):
        check_tokenizer_fits(100, 100, "t", " (fix)", eos_id=0, model_eos=(1, 2))
    assert model_eos_ids(SimpleNamespace(eos_token_id=[128001, 128009])) == (128001, 128009)
    assert model_eos_ids(SimpleNamespace(eos_token_id=2)) == (2,)
    assert model_eos_ids(SimpleNamespace(eos_token_id=None)) is None and model_eos_ids(SimpleNamespace()) is None


def test_a_prepared_folder_is_read_whole_or_refused(prepared, tmp_path, monkeypatch, capsys):
    """``meta.json`` goes first and comes back last: a re-run that fails half-way (here: while
    writing valid.jsonl, with another block size) leaves no set to train on; files of two
    preparations side by side, or a changed file, are refused naming the file."""
    import shutil

    import lora_core.data.nlg as nlg
    from examples.lm import prepare as lm_prepare
    from lora_core.data.text import read_prepared

    root, out = prepared
    tok = json.loads((out / "meta.json").read_text())["tokenizer"]
    folder = tmp_path / "p"
    shutil.copytree(out, folder)
    train, valid, meta = read_prepared(folder)
    assert len(train) == meta["train_blocks"] and len(valid) == meta["valid_blocks"] and len(meta["sha256"]) == 2
    write = nlg.write_text_atomic

    def fail_on_valid(path, text):
        if str(path).endswith("valid.jsonl"):
            raise OSError(28, "No space left on device")
        write(path, text)

    monkeypatch.setattr(nlg, "write_text_atomic", fail_on_valid)
    args = ["--tokenizer", tok, "--train", str(root / "a.txt"), str(root / "b.txt"), "--valid", str(root / "v.txt")]
    assert lm_prepare.main(args + ["--block-size", "16", "--out-dir", str(folder)]) == 1
    assert "error: [Errno 28] No space left on device" in capsys.readouterr().err
    monkeypatch.setattr(nlg, "write_text_atomic", write)
    assert not (folder / "meta.json").exists()  # train.jsonl of block 16 beside valid.jsonl of block 32
    with pytest.raises(FileNotFoundError, match="meta.json: no such file .* a preparation that failed half-way"):
        read_prepared(folder)
    # the two files of two preparations (counts or lengths differ), and a changed file (SHA-256)
    other = tmp_path / "o"
    assert lm_prepare.main(args + ["--block-size", "16", "--out-dir", str(other)]) == 0
    shutil.copytree(out, folder, dirs_exist_ok=True)
    shutil.copy(other / "valid.jsonl", folder / "valid.jsonl")
    with pytest.raises(ValueError, match=r"valid.jsonl: \d+ blocks, but .*meta.json says \d+: the folder mixes two"):
        read_prepared(folder)
    shutil.copy(out / "valid.jsonl", folder / "valid.jsonl")
    shutil.copy(other / "train.jsonl", folder / "train.jsonl")
    with pytest.raises(ValueError, match="blocks, but"):
        read_prepared(folder)
    shutil.copy(out / "train.jsonl", folder / "train.jsonl")
    lines = (folder / "train.jsonl").read_text().splitlines()
    first = json.loads(lines[0])["ids"]
    lines[0] = json.dumps({"ids": first[1:] + first[:1]})  # the same tokens, in another order
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"train.jsonl: not the file .*meta.json describes \(its SHA-256 differs"):
        read_prepared(folder)
    lines[0] = json.dumps({"ids": first[:-1] + [meta["vocab_size"]]})
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=f"train.jsonl: line 1: token id {meta['vocab_size']} is not below"):
        read_prepared(folder)


def test_generated_ids_without_text_are_named(prepared, capsys):
    """Ids in a model's padded rows beyond the tokenizer's have no text: said, not dropped silently."""
    from examples.lm.generate import continuations
    from lora_core.data.text import load_text_tokenizer

    _, out = prepared
    tok = load_text_tokenizer(json.loads((out / "meta.json").read_text())["tokenizer"])
    ctx = tok.encode("The restaurant")
    word = tok.encode(" is")
    assert continuations(tok, [ctx], [word + [tok.eos_id]]) == [" is"]
    assert capsys.readouterr().err == ""
    assert continuations(tok, [ctx, ctx], [word, [tok.vocab_size + 3] + word]) == [" is", " is"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"prompt 2: generated token id(s) [{tok.vocab_size + 3}] beyond" in err, err


def test_a_zero_stage_the_backend_cannot_run_is_refused_before_the_model_loads(prepared, tmp_path, capsys):
    """jittor has no ZeRO-3: refused by name before the base is built or written (it was refused
    only once the trainer started: after loading, and writing OUT/base of a --save-base run)."""
    from examples.lm import train as lm_train

    _, out = prepared
    argv = ["--backend", "jittor", "--recipe", "lm-demo", "--prepared", str(out), "--random-init", "tiny-llama",
            "--vocab-size", str(_vocab(out)), "--save-base", "--zero", "3", "--no-progress",
            "--out-dir", str(tmp_path / "z3")]  # fmt: skip
    assert lm_train.main(argv) == 1
    err = capsys.readouterr().err
    assert "--zero 3 (sharded parameters) is not available in the jittor backend" in err, err
    assert not (tmp_path / "z3" / "base").exists()
