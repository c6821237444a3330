"""Our GPT-2 encoding equals transformers' GPT2TokenizerFast (and the paper's BPE) on every shared line."""

import json
import shutil
import time
from functools import lru_cache

import pytest

from lora_core.data.convert import convert_e2e
from lora_core.data.nlg import read_formatted
from lora_core.data.tokenizer import encode_example, encode_file, load_tokenizer

FILES = [
    "e2e/train.txt", "e2e/valid.txt", "e2e/test.txt",
    "webnlg/train_formatted.jsonl", "webnlg/valid_formatted.jsonl", "webnlg/test_formatted.jsonl",
    "dart/train_formatted.jsonl", "dart/valid_formatted.jsonl", "dart/test_formatted.jsonl",
]  # fmt: skip


@pytest.fixture(scope="module")
def vocab_dir(shared_dir):
    d = shared_dir / "data/gpt2-vocab"
    if not (d / "encoder.json").is_file():
        pytest.skip(f"shared GPT-2 vocabulary missing: {d} (set LORA_SHARED)")
    return d


@pytest.fixture(scope="module")
def all_records(shared_dir, vocab_dir):
    out = {}
    for name in FILES:
        path = shared_dir / "data" / name
        # allow_empty: dart/test_formatted.jsonl line 117 has an empty completion
        out[name] = convert_e2e(path) if name.endswith(".txt") else read_formatted(path, allow_empty=True)
    return out


@pytest.fixture(scope="module")
def hf_tokenizer(vocab_dir):
    """transformers' GPT-2 tokenizer built from OpenAI's encoder.json + vocab.bpe (no hub)."""
    from transformers import GPT2TokenizerFast

    vocab = json.loads((vocab_dir / "encoder.json").read_text(encoding="utf-8"))
    merges = [tuple(m.split()) for m in (vocab_dir / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:] if m]
    return GPT2TokenizerFast(vocab=vocab, merges=merges)


def test_gpt2_ids(vocab_dir):
    tok = load_tokenizer(vocab_dir)
    assert (tok.eos_id, tok.stop_ids, tok.vocab_size) == (50256, (50256, 628), 50257)
    ctx, comp = encode_example(tok, "name : Blue Spice", "Blue Spice is here .")
    assert ctx == tok.encode("name : Blue Spice") + [50256]
    assert comp == tok.encode(" Blue Spice is here .") + [50256]
    assert tok.encode("\n\n") == [628]
    assert tok.decode([383, 50256, 628]) == " The<|endoftext|>\n\n"


@pytest.fixture(scope="module")
def texts(all_records):
    """Every context and " " + completion of the shared files, once each (73k of 116k)."""
    return list(
        dict.fromkeys(t for recs in all_records.values() for r in recs for t in (r["context"], " " + r["completion"]))
    )


@pytest.fixture(scope="module")
def hf_ids(texts, hf_tokenizer):
    t0 = time.perf_counter()
    ids = hf_tokenizer(texts, add_special_tokens=False)["input_ids"]
    print(f"\nGPT2TokenizerFast: {len(texts)} unique texts in {time.perf_counter() - t0:.1f} s")
    return dict(zip(texts, ids))


@pytest.mark.parametrize("loader", ["vocab-files", "tokenizer.json"])
def test_identity_with_transformers_on_all_shared_lines(loader, vocab_dir, all_records, texts, hf_ids, tmp_path):
    """Every line of the 9 shared E2E/WebNLG/DART files encodes as GPT2TokenizerFast encodes it."""
    if loader == "vocab-files":  # a folder with only OpenAI's files, as gpt2_encode.py reads them
        for f in ("encoder.json", "vocab.bpe"):
            shutil.copy(vocab_dir / f, tmp_path / f)
        spec = tmp_path
    else:
        if not (vocab_dir / "tokenizer.json").is_file():
            pytest.skip("no tokenizer.json in the shared vocabulary")
        spec = vocab_dir
    tok = load_tokenizer(spec)
    t0 = time.perf_counter()
    ours = tok.encode_batch(texts)
    elapsed = time.perf_counter() - t0
    for text, ids in zip(texts, ours):
        assert ids == hf_ids[text], text
    n_lines = sum(len(r) for r in all_records.values())
    print(
        f"\n{loader}: {n_lines} lines ({len(texts)} unique texts) identical to GPT2TokenizerFast; ours {elapsed:.1f} s"
    )
    assert n_lines == 7570 + 4672 + 4693 + 3244 + 2258 + 4928 + 11278 + 6980 + 12552


def test_encode_file_layout(vocab_dir, all_records, hf_ids):
    """encode_file: bpe(context) + [eos], bpe(" " + completion) + [eos], cate kept (WebNLG test, E2E test)."""
    tok = load_tokenizer(vocab_dir / "tokenizer.json")
    for name in ("webnlg/test_formatted.jsonl", "e2e/test.txt"):
        records = all_records[name]
        encoded = encode_file(tok, records, batch_size=1000)
        assert len(encoded) == len(records)
        for i, (e, r) in enumerate(zip(encoded, records)):
            assert e["context"] == hf_ids[r["context"]] + [50256], f"{name} line {i + 1}"
            assert e["completion"] == hf_ids[" " + r["completion"]] + [50256], f"{name} line {i + 1}"
            assert e.get("cate") == r.get("cate")


# An independent reference: the byte-level BPE of OpenAI's encoder.py, which the paper's
# gpt2_encode.py runs (pure Python; checked on every 10th line to keep the test short).
def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class PaperBPE:
    def __init__(self, vocab_dir):
        import regex

        self.encoder = json.loads((vocab_dir / "encoder.json").read_text(encoding="utf-8"))
        merges = (vocab_dir / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:-1]
        self.ranks = {tuple(m.split()): i for i, m in enumerate(merges)}
        self.byte_encoder = _bytes_to_unicode()
        self.pat = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
        self.bpe = lru_cache(maxsize=None)(self._bpe)

    def _bpe(self, token: str) -> tuple[str, ...]:
        word = tuple(token)
        while len(word) > 1:
            pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        return word

    def encode(self, text: str) -> list[int]:
        ids = []
        for token in self.pat.findall(text):
            token = "".join(self.byte_encoder[b] for b in token.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(token))
        return ids


def test_identity_with_paper_bpe(vocab_dir, all_records):
    tok = load_tokenizer(vocab_dir)
    ref = PaperBPE(vocab_dir)
    n = 0
    for name, records in all_records.items():
        sample = records[::10]
        ours = encode_file(tok, sample)
        for i, (o, r) in enumerate(zip(ours, sample)):
            assert o["context"] == ref.encode(r["context"]) + [50256], f"{name} line {10 * i + 1}"
            assert o["completion"] == ref.encode(" " + r["completion"]) + [50256], f"{name} line {10 * i + 1}"
        n += len(sample)
    assert n > 5800


def test_decode_round_trip(vocab_dir, all_records):
    tok = load_tokenizer(vocab_dir)
    for records in all_records.values():
        for r in records[::50]:
            assert tok.decode(tok.encode(" " + r["completion"])) == " " + r["completion"]


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor encoder.json"):
        load_tokenizer(tmp_path)
    # a path that is not there: said so, without trying the hub
    for spec in (tmp_path / "nope", "./nope", "runs/x/tok"):
        with pytest.raises(FileNotFoundError, match=f"{spec}: no such tokenizer file or folder$"):
            load_tokenizer(spec)
    # a tokenizer without the end-of-text token: the file named, where the token comes from
    import tokenizers

    bare = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    bare.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"tokenizer.json: eos token '<\|endoftext\|>' is not in the vocabulary \(the end"):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_tokenizer_json_settings_do_not_cut_and_prompts_get_the_bos(tmp_path):
    """A tokenizer.json saved with truncation or padding settings still encodes whole texts and
    unpadded batches (transformers switches them off unless asked); a prompt gets what the
    post-processor puts first (Llama 3's BOS), the text task's documents do not."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, processors


    vocab = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "[UNK]": 2, "a": 3, "b": 4, "c": 5, "d": 6}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", 0)])  # fmt: skip
    backend.enable_truncation(max_length=2)
    backend.enable_padding(pad_id=1, pad_token="<|end_of_text|>", length=6)
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "tokenizer.json", "<|end_of_text|>")
    assert tok.encode("a b c d") == [3, 4, 5, 6] and tok.encode_batch(["a b c d", "a"]) == [[3, 4, 5, 6], [3]]
    assert tok.encode_prompt("a b") == [0, 3, 4]
