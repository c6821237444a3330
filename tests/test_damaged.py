"""Damaged files: every loader (adapter, base model .safetensors / .bin in both torch.save
formats, trainer state, beam JSONL) names the file and what is wrong with it when the file
was cut short or is random bytes; ``--resume`` on a run whose latest checkpoint is damaged
names the damage and the newest intact checkpoint, and ``--resume-from`` continues from it."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import lora_core as lc
from examples.nlg import train as train_cli
from lora_core.data.nlg import DataFormatError, write_jsonl_atomic
from lora_core.formats.checkpoint import CheckpointError, read_tensors, save_model
from lora_core.generate.decode import read_beam_jsonl
from lora_core.models.gpt2 import TRANSPOSED
from lora_core.train.optim import pack_state
from lora_core.train.run_dir import read_checkpoint, resume_point, write_checkpoint
from lora_core.train.tasks import GPT2AdapterFiles

CFG, LORA = lc.gpt2_config("tiny-32"), lc.LoRAConfig(r=2)
ADAPTER = GPT2AdapterFiles(CFG, LORA)


def cut(path: Path) -> None:
    """What an interrupted copy leaves: the first half of the bytes."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def garbage(path: Path) -> None:
    """Random bytes (seeded) of the file's size."""
    path.write_bytes(np.random.default_rng(0).bytes(max(path.stat().st_size, 64)))


# --------------------------------------------------------------------------- the files


def _hf_state(prefix="transformer."):
    """GPT-2 weights under HF names (Conv1D weights (in, out)), as a pretrained file holds them."""
    out = {}
    for k, v in lc.init_gpt2_weights(CFG).items():
        out[prefix + k] = v.T.copy() if k.endswith(TRANSPOSED) else v
    return out


def _adapter(d: Path):
    lc.save_adapter(d, CFG, LORA, lc.init_lora_weights(CFG, LORA))
    return d / "adapter.safetensors", lambda: lc.load_adapter(d)


def _base_safetensors(d: Path):
    from safetensors.numpy import save_file

    d.mkdir()
    save_file(_hf_state(), str(d / "model.safetensors"))
    return d / "model.safetensors", lambda: lc.load_gpt2_checkpoint(d, CFG)


def _saved_model(d: Path):
    save_model(d, CFG, lc.init_gpt2_weights(CFG))
    return d / "model.safetensors", lambda: lc.load_model(d)


def _base_bin(legacy: bool):
    def make(d: Path):
        import torch

        d.mkdir()
        state = {k: torch.from_numpy(v) for k, v in _hf_state().items()}
        torch.save(state, d / "pytorch_model.bin", _use_new_zipfile_serialization=not legacy)
        return d / "pytorch_model.bin", lambda: lc.load_gpt2_checkpoint(d, CFG)

    return make


def _checkpoint(d: Path):
    """A run folder with one checkpoint written as the trainer writes it (no backend needed)."""
    shapes = lc.formats.checkpoint.adapter_shapes(CFG, LORA)
    moments = {n: np.full(s, 0.5, np.float32) for n, s in shapes.items()}
    meta = {"step": 3, "epoch": 0, "batch_in_epoch": 3, "examples_seen": 12, "tokens_seen": 99}
    d.mkdir()
    ckpt = write_checkpoint(d, 3, ADAPTER, lc.init_lora_weights(CFG, LORA), pack_state(moments, moments, 3), meta)
    return ckpt, lambda: read_checkpoint(ckpt, ADAPTER)


def _trainer_tensors(d: Path):
    ckpt, load = _checkpoint(d)
    return ckpt / "trainer_state.safetensors", load


def _trainer_json(d: Path):
    ckpt, load = _checkpoint(d)
    return ckpt / "trainer_state.json", load


def _beam(d: Path):
    d.mkdir()
    path = d / "beam.jsonl"
    write_jsonl_atomic(path, ({"index": i, "tokens": [5 * i + j for j in range(7)]} for i in range(10)))
    return path, lambda: read_beam_jsonl(path, 10, vocab_size=100)


# (file maker, error type, what a cut file is called, what a random-bytes file is called)
CASES = {
    "adapter": (_adapter, CheckpointError, "truncated safetensors file", "not a safetensors file"),
    "base-safetensors": (_base_safetensors, CheckpointError, "truncated safetensors file", "not a safetensors file"),
    "saved-model": (_saved_model, CheckpointError, "truncated safetensors file", "not a safetensors file"),
    "base-bin-zip": (_base_bin(False), CheckpointError, "truncated zip archive", "not a PyTorch checkpoint"),
    "base-bin-legacy": (_base_bin(True), CheckpointError, "truncated legacy PyTorch file", "not a PyTorch checkpoint"),
    "trainer-state": (_trainer_tensors, CheckpointError, "truncated safetensors file", "not a safetensors file"),
    "trainer-json": (_trainer_json, CheckpointError, "truncated JSON file", "not a JSON file"),
    "beam-jsonl": (
        _beam,
        DataFormatError,
        "line 6: truncated: the file ends inside this line",
        "line 1: not valid UTF-8",
    ),
}


@pytest.mark.parametrize("damage", ["cut", "garbage"])
@pytest.mark.parametrize("kind", list(CASES))
def test_damaged_file_is_named_with_its_problem(kind, damage, tmp_path):
    make, error, cut_says, garbage_says = CASES[kind]
    path, load = make(tmp_path / kind)
    load()  # intact: loads
    (cut if damage == "cut" else garbage)(path)
    with pytest.raises(error) as e:
        load()
    msg = str(e.value)
    assert msg.startswith(str(path)), msg
    assert (cut_says if damage == "cut" else garbage_says) in msg, msg


def test_beam_jsonl_cut_at_a_line_end(tmp_path):
    path, load = _beam(tmp_path / "b")
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:4]))
    with pytest.raises(
        DataFormatError,
        match=re.escape(f"{path}: 4 predictions for 10 unique contexts") + r".*was the file cut short\?",
    ):
        load()


def test_wrong_tensor_names_in_the_trainer_state(tmp_path):
    from safetensors.numpy import save_file

    ckpt, load = _checkpoint(tmp_path / "run")
    opt = read_tensors(ckpt / "trainer_state.safetensors")
    opt["m.h.0.attn.c_attn.lora_X"] = opt.pop("m.h.0.attn.c_attn.lora_A")
    save_file(opt, str(ckpt / "trainer_state.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load()
    msg = str(e.value)
    assert msg.startswith(str(ckpt / "trainer_state.safetensors")), msg
    assert "missing keys (1): ['m.h.0.attn.c_attn.lora_A']" in msg and "m.h.0.attn.c_attn.lora_X" in msg


def test_pickle_outside_a_state_dict_is_refused_not_run(tmp_path):
    """A .bin whose first pickle calls a function: refused, and the function never runs."""
    marker = tmp_path / "ran"
    (tmp_path / "evil.bin").write_bytes(b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    with pytest.raises(CheckpointError, match="not a PyTorch checkpoint.*refusing to load os.system"):
        read_tensors(tmp_path / "evil.bin")
    assert not marker.exists()


def test_from_pretrained_with_a_cut_adapter(backend, tmp_path):
    save_model(tmp_path / "base", CFG, lc.init_gpt2_weights(CFG))
    weights, _ = _adapter(tmp_path / "ad")
    cut(weights)
    with pytest.raises(CheckpointError, match=re.escape(f"{weights}: truncated safetensors file")):
        backend.from_pretrained(tmp_path / "base", adapter=tmp_path / "ad")


# --------------------------------------------------------------------------- --resume


def _cli_args(backend_name, tmp_path):
    rng = np.random.default_rng(0)
    data = tmp_path / "train.jsonl"
    pairs = [
        {"context": rng.integers(1, 64, 6).tolist(), "completion": rng.integers(1, 64, 4).tolist()} for _ in range(24)
    ]
    write_jsonl_atomic(data, pairs)
    out = tmp_path / "run"
    return (
        f"--backend {backend_name} --recipe toy --train {data} --random-init tiny-32 --vocab-size 64 "
        f"--max-steps 6 --no-progress --out-dir {out} --set batch_size=4 warmup=1 save_every=2 eval_every=0 "
        "lora_dropout=0.1"
    ).split()


def test_resume_names_the_intact_checkpoint_and_resumes_from_it(backend, tmp_path, capsys):
    args, run = _cli_args(backend.NAME, tmp_path), tmp_path / "run"
    assert train_cli.main(args) == 0
    want = read_tensors(run / "ckpt-6" / "adapter.safetensors")
    cut(run / "ckpt-6" / "adapter.safetensors")
    garbage(run / "ckpt-4" / "trainer_state.safetensors")
    capsys.readouterr()
    assert train_cli.main(args + ["--resume"]) == 1
    err = capsys.readouterr().err
    assert f"{run / 'ckpt-6' / 'adapter.safetensors'}: truncated safetensors file" in err, err
    assert f"newest intact checkpoint is {run / 'ckpt-2'} (step 2)" in err, err  # ckpt-4 is damaged too
    option = re.search(r"--resume-from (\S+)", err)
    assert option and option.group(1) == str(run / "ckpt-2"), err
    assert (run / "latest").read_text() == "ckpt-6\n"  # nothing was picked silently

    assert train_cli.main(args + ["--resume-from", option.group(1)]) == 0
    got = read_tensors(run / "ckpt-6" / "adapter.safetensors")
    assert all(np.array_equal(got[n], want[n]) for n in want), "resumed run differs from the uninterrupted one"
    assert read_tensors(run / "ckpt-4" / "trainer_state.safetensors")  # rewritten
    steps = [r["step"] for r in map(json.loads, (run / "log.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == 6


def test_resume_without_an_intact_checkpoint(tmp_path):
    ckpt, _ = _checkpoint(tmp_path / "run")
    shutil.copytree(ckpt, tmp_path / "run" / "ckpt-1")
    garbage(tmp_path / "run" / "ckpt-1" / "adapter_config.json")
    (ckpt / "trainer_state.json").unlink()
    with pytest.raises(CheckpointError) as e:
        resume_point(tmp_path / "run", ADAPTER)
    msg = str(e.value)
    assert f"{ckpt}: incomplete checkpoint, missing ['trainer_state.json']" in msg, msg
    assert "No earlier checkpoint" in msg and "reads completely" in msg, msg
    (tmp_path / "run" / "latest").write_bytes(b"\xff\x00ckpt")  # a garbled pointer: damage too
    with pytest.raises(CheckpointError, match="damaged pointer file"):
        resume_point(tmp_path / "run", ADAPTER)


def test_safetensors_read_as_copy_on_write_memory_maps(tmp_path):
    """A base read from .safetensors is memory-mapped (ranks share its pages), equal to the
    library's copy, and writable without touching the file."""
    import mmap

    from safetensors.numpy import load_file, save_file

    from lora_core.formats.tensor_files import read_safetensors

    path = tmp_path / "m.safetensors"
    tensors = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "t": np.array(3, dtype=np.int64),
               "e": np.zeros((0, 2), np.float32)}
    save_file(tensors, str(path))
    got = read_safetensors(path, mmap=True)
    ref = load_file(str(path))
    assert got.keys() == ref.keys() and all(np.array_equal(got[k], ref[k]) and got[k].dtype == ref[k].dtype for k in ref)
    base = got["w"]
    while getattr(base, "base", None) is not None and not isinstance(base, mmap.mmap):
        base = base.base
    assert isinstance(base, mmap.mmap), type(base)
    got["w"][0, 0] = 99.0
    assert read_safetensors(path, mmap=True)["w"][0, 0] == 0.0


def test_base_model_is_memory_mapped(tmp_path):
    """The frozen base of a ``save_model`` folder (as of an HF ``model.safetensors``) is read as maps."""
    import mmap

    cfg = lc.gpt2_config("tiny-32")
    save_model(tmp_path / "base", cfg, lc.init_gpt2_weights(cfg))
    _, _, tensors = lc.load_model(tmp_path / "base")
    base = tensors["wte.weight"]
    while getattr(base, "base", None) is not None and not isinstance(base, mmap.mmap):
        base = base.base
    assert isinstance(base, mmap.mmap), type(base)


def _flip_a_storage_byte(path: Path) -> None:
    """One byte changed in the middle of the largest tensor's data (a bad disk, a bad copy)."""
    import zipfile

    with zipfile.ZipFile(path) as zf:
        info = max(zf.infolist(), key=lambda i: i.file_size)
        data = zf.read(info)
    raw = bytearray(path.read_bytes())
    at = raw.find(data) + len(data) // 2
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(  # a legacy file has no checksum: a flipped byte is not detected by either reader
    "legacy, damage",
    [(False, "cut"), (False, "garbage"), (False, "flipped"), (True, "cut"), (True, "garbage")],
    ids=["zip-cut", "zip-garbage", "zip-flipped", "legacy-cut", "legacy-garbage"],
)
def test_damaged_bin_quantized_while_loading_gives_the_same_error(backend, legacy, damage, tmp_path):
    """The 4-bit loader reads a .bin tensor by tensor (``load_torch_file(lazy=True)``: memory
    maps, CRC-32 checked on the first read); a damaged file raises the error the whole-file
    reader raises. (A legacy file has no checksum: a changed byte is not detected by either.)"""
    from lora_core.train.full_ft import hf_config

    path, _ = _base_bin(legacy)(tmp_path / "base")
    (path.parent / "config.json").write_text(json.dumps(hf_config(CFG)))
    backend.from_pretrained(path.parent, quantize="nf4")  # intact: loads
    {"cut": cut, "garbage": garbage, "flipped": _flip_a_storage_byte}[damage](path)
    with pytest.raises(CheckpointError) as whole:
        read_tensors(path)
    with pytest.raises(CheckpointError) as streamed:
        backend.from_pretrained(path.parent, quantize="nf4")
    msg = str(streamed.value)
    assert msg == str(whole.value)
    says = {"cut": "truncated legacy PyTorch file" if legacy else "truncated zip archive",
            "garbage": "not a PyTorch checkpoint", "flipped": "damaged PyTorch zip archive (BadZipFile: Bad CRC-32"}
    assert msg.startswith(str(path)) and says[damage] in msg, msg


# --------------------------------------------------------------------------- intact files we do not read


def test_safetensors_dtypes_beside_bfloat16_and_unsupported_ones(tmp_path):
    """Unsigned ints beside a bfloat16 tensor are read in every mode; a float8 tensor is refused
    naming the tensor and its dtype (not an AttributeError from the reader)."""
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "mixed.safetensors"
    save_file({"w": torch.tensor([1.5, -2.0], dtype=torch.bfloat16), "u": torch.tensor([7, 70000], dtype=torch.uint32),
               "h": torch.tensor([3], dtype=torch.uint16)}, str(path))  # fmt: skip
    for kw in ({}, {"mmap": True}, {"lazy": True}):
        t = read_tensors(path, **kw)
        assert np.asarray(t["w"]).tolist() == [1.5, -2.0] and t["u"].tolist() == [7, 70000] and t["h"].tolist() == [3]
    save_file({"ok": torch.ones(2), "f8": torch.ones(2).to(torch.float8_e4m3fn)}, str(tmp_path / "f8.safetensors"))
    for kw in ({}, {"mmap": True}):
        with pytest.raises(CheckpointError, match=r"f8\.safetensors: tensor f8 has dtype F8_E4M3"):
            read_tensors(tmp_path / "f8.safetensors", **kw)


@pytest.mark.parametrize("legacy", [False, True])
def test_torch_file_of_an_unread_dtype_is_named_not_called_damaged(legacy, tmp_path):
    import torch

    path = tmp_path / "w.bin"
    for dtype, named in ((torch.uint16, "_rebuild_tensor_v3"), (torch.complex64, "ComplexFloatStorage")):
        torch.save({"a": torch.ones(2, dtype=dtype)}, path, _use_new_zipfile_serialization=not legacy)
        with pytest.raises(CheckpointError, match=named) as e:
            read_tensors(path)
        assert "damaged" not in str(e.value) and str(path) in str(e.value)


def test_big_endian_torch_archive_is_refused(tmp_path):
    """A zip archive whose byteorder record says big: refused (its storages would read as other
    numbers), for the streamed reader too."""
    import zipfile

    import torch

    torch.save({"w": torch.tensor([1.0, 2.0])}, tmp_path / "le.bin")
    with zipfile.ZipFile(tmp_path / "le.bin") as zin, zipfile.ZipFile(tmp_path / "be.bin", "w") as zout:
        for n in zin.namelist():
            data = zin.read(n)
            if n.endswith("/byteorder"):
                data = b"big"
            elif "/data/" in n:
                data = np.frombuffer(data, "<f4").astype(">f4").tobytes()
            zout.writestr(n, data)
    assert torch.load(tmp_path / "be.bin")["w"].tolist() == [1.0, 2.0]  # what the file means
    for lazy in (False, True):
        with pytest.raises(CheckpointError, match="byteorder record says 'big'"):
            read_tensors(tmp_path / "be.bin", lazy=lazy)


def test_index_with_a_shard_that_is_not_a_file_name(tmp_path):
    from safetensors.numpy import save_file

    from lora_core.formats.hf_checkpoint import read_hf_weights

    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors", "b": None}}))
    with pytest.raises(CheckpointError, match=r"index\.json: weight_map gives 'b' the shard None"):
        read_hf_weights(tmp_path)


@pytest.mark.parametrize("field, value", [("nested_blocksize", None), ("nested_blocksize", 0),
                                          ("nested_blocksize", "256"), ("nested_offset", "x")])  # fmt: skip
def test_damaged_nested_quant_state_is_named(field, value):
    from lora_core.formats.bnb4bit import split_bnb4bit
    from lora_core.quant.nf4 import NF4_CODE, dynamic_map

    qs = {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [64, 128], "nested_blocksize": 256,
          "nested_dtype": "float32", "nested_offset": 0.05, field: value}  # fmt: skip
    qs = {k: v for k, v in qs.items() if v is not None}
    k = "m.weight"
    parts = {k: np.zeros((4096, 1), np.uint8), k + ".absmax": np.zeros(128, np.uint8), k + ".quant_map": NF4_CODE.copy(),
             k + ".nested_absmax": np.ones(1, np.float32), k + ".nested_quant_map": dynamic_map(),
             k + ".quant_state.bitsandbytes__nf4": np.frombuffer(json.dumps(qs).encode(), np.uint8).copy()}  # fmt: skip
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: {k}\.quant_state\.bitsandbytes__nf4: damaged .*{field}"):
        split_bnb4bit(parts, "model.safetensors")


@pytest.mark.parametrize("hard", [False, True])
def test_more_tensors_than_the_open_file_limit(hard, tmp_path):
    """Each tensor's memory map holds a file descriptor: a file with more tensors than the soft
    limit raises it (up to the hard limit); where the hard limit is too low, one map of the
    whole file serves every tensor. Same values either way."""
    import subprocess
    import sys

    from safetensors.numpy import save_file

    save_file({f"t{i}": np.full((3,), i, np.float32) for i in range(600)}, str(tmp_path / "many.safetensors"))
    code = f"""
import resource, numpy as np
resource.setrlimit(resource.RLIMIT_NOFILE, (256, {256 if hard else 4096}))
from lora_core.formats.tensor_files import read_tensors
t = read_tensors({str(tmp_path / "many.safetensors")!r}, mmap=True)
assert all(t[f"t{{i}}"].tolist() == [i] * 3 for i in range(600))
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(out) == 256 if hard else int(out) > 600


def test_a_save_killed_over_an_older_one_never_pairs_new_weights_with_old_settings(tmp_path, monkeypatch):
    """Saving over an adapter (or model) folder removes its old config first and writes the new
    config last: a kill after the weights leaves a folder the loader calls incomplete, not the new
    weights under the old adapter's scaling."""
    import lora_core.formats.checkpoint as ck

    d = tmp_path / "adapter"
    lc.save_adapter(d, CFG, LORA, lc.init_lora_weights(CFG, LORA))
    other = lc.LoRAConfig(r=2, alpha=32)

    def killed(path, obj):
        raise KeyboardInterrupt("killed")  # what a kill after the weights' rename leaves

    monkeypatch.setattr(ck, "write_json_atomic", killed)
    with pytest.raises(KeyboardInterrupt):
        lc.save_adapter(d, CFG, other, lc.init_lora_weights(CFG, other))
    monkeypatch.undo()
    assert not (d / "adapter_config.json").exists() and (d / "adapter.safetensors").exists()
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        lc.load_adapter(d)
    lc.save_adapter(d, CFG, other, lc.init_lora_weights(CFG, other))  # a complete save reads again
    assert lc.load_adapter(d)[0].alpha == 32


def test_a_resumed_run_keeps_its_whole_base_and_writes_a_cut_one_again(tmp_path):
    """``--resume`` with ``--save-base`` (or a 4-bit base, quantized from OUT/base): a whole
    OUT/base is kept as it is (writing it again removed its config first, so a kill in that window
    left the first run's base unreadable); a base without its config is written again; a new run
    writes it."""
    from types import SimpleNamespace

    from examples.run_options import write_base

    base = tmp_path / "base"
    calls = []

    def write(d, *payload):
        calls.append(payload)
        save_model(d, CFG, lc.init_gpt2_weights(CFG, 0))

    write_base(SimpleNamespace(resume=False, resume_from=None), base, write, "new run")
    before = (base / "model.safetensors").stat().st_mtime_ns
    for resume, resume_from in ((True, None), (False, "ckpt-3")):
        write_base(SimpleNamespace(resume=resume, resume_from=resume_from), base, write, "resumed")
    assert calls == [("new run",)] and (base / "model.safetensors").stat().st_mtime_ns == before
    (base / "config.json").unlink()  # a save cut before its config: written again on resume
    write_base(SimpleNamespace(resume=True, resume_from=None), base, write, "cut")
    assert calls[-1] == ("cut",) and lc.load_model(base)[0] == CFG


def test_damaged_run_configuration_is_named_on_resume(tmp_path):
    from lora_core.train.run_dir import open_run_dir

    out = tmp_path / "run"
    out.mkdir()
    for text, words in (('{"task": "nlg", "train": {', "train_config.json: "),
                        ('["a list"]', "train_config.json: expected a JSON object, got list")):
        (out / "train_config.json").write_text(text)
        with pytest.raises(CheckpointError) as e:
            open_run_dir(out, {"task": "nlg"}, resume=True, adapter=ADAPTER)
        assert str(out / "train_config.json") in str(e.value) and words in str(e.value), str(e.value)


def test_a_folder_named_latest_is_refused_before_training(tmp_path):
    from lora_core.train.run_dir import check_out_dir

    (tmp_path / "run" / "latest").mkdir(parents=True)
    for resume in (False, True):
        with pytest.raises(ValueError, match="latest is not a file: the run's pointer to its latest checkpoint"):
            check_out_dir(tmp_path / "run", resume, option="--out-dir")
