"""Compiled training step (torch ``set_compile``): the same updates as the eager step (numpy
dropout masks, padded shape buckets), one compilation per bucket, the CLI switch; the bucket
policy and padding of ``lora_core.train.buckets``; jittor refuses the switch.

The tests compile with dynamo's ``aot_eager`` backend (the same captured graph, forward and
backward, without inductor's C++ code generation, which takes minutes on a 2-core CPU); the
real switch uses inductor.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import lora_core
from examples.nlg import train as train_cli
from lora_core.data.batching import collate
from lora_core.data.nlg import write_jsonl_atomic
from lora_core.formats.checkpoint import read_tensors
from lora_core.lora.dropout import NumpyDropout
from lora_core.train.buckets import bucket_shape, count_bucket, length_bucket, pad_to_bucket
from lora_core.train.recipes import TrainConfig
from lora_core.train.trainer import read_log, train

STEPS = 6
CFG = TrainConfig(batch_size=4, grad_accum=2, lr=1e-2, warmup=0, lora_r=4, lora_dropout=0.2, dropout_masks="numpy",
                  label_smooth=0.1, max_grad_norm=1.0, max_steps=STEPS, log_every=1, save_every=0, eval_every=0)


def _pairs(n: int, seed: int = 1, short: int = 8, long: int = 11) -> list[tuple[list[int], list[int]]]:
    """Random examples with contexts and completions of ``short`` to ``long - 1`` tokens (two of
    them: 32 to 40 packed tokens, 16 to 20 loss positions: a few buckets, met repeatedly)."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(1, 999, rng.integers(short, long)).tolist(), rng.integers(1, 999, rng.integers(short, long)).tolist())
            for _ in range(n)]


def _train(out_dir, compile_backend: str | None, grad_checkpoint: bool = False, pad_to: int | None = None):
    torch_be = lora_core.get_backend("torch")
    cfg = lora_core.gpt2_config("tiny")
    model = torch_be.build_model(cfg, CFG.lora_config(), base=lora_core.init_gpt2_weights(cfg, 0))
    torch_be.set_grad_checkpoint(model, grad_checkpoint)
    if compile_backend:
        torch_be.set_compile(model, True, compile_backend)
    train(torch_be, model, _pairs(16), None, dataclasses.replace(CFG, pad_to=pad_to), out_dir, progress=False)
    losses = [r["loss"] for r in read_log(out_dir / "log.jsonl") if r["kind"] == "train"]
    return np.array(losses), read_tensors(out_dir / f"ckpt-{STEPS}" / "adapter.safetensors"), model


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    """Relative difference in norm (a tensor's largest element-wise one is up to 10x more: Adam
    divides near-zero gradients by their own size, which magnifies their rounding)."""
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("eager"), None)


def _assert_close(run, ref, tol: float) -> None:
    (losses, weights, _), (ref_losses, ref_weights, _) = run, ref
    assert len(losses) == STEPS and _rel(losses, ref_losses) < tol
    assert sorted(weights) == sorted(ref_weights) and any("lora_B" in n for n in weights)
    assert max(_rel(weights[n], ref_weights[n]) for n in weights) < tol
    assert any(np.abs(weights[n]).max() > 0 for n in weights if "lora_B" in n)  # it trained


def test_compiled_matches_eager(eager, tmp_path):
    """Six updates of two micro-batches with LoRA dropout 0.2 in numpy-mask mode: losses and
    adapter within 1e-5 relative of the eager step (measured: losses 3.4e-8, adapter 3.2e-6
    in norm, 3.0e-5 at worst element-wise), and the same as the eager step on rows padded to
    the bucket's length (measured: identical), so padding the token and loss counts changes
    nothing; one compilation per bucket."""
    run = _train(tmp_path / "compiled", "aot_eager")
    _assert_close(run, eager, 1e-5)
    _assert_close(run, _train(tmp_path / "eager32", None, pad_to=32), 1e-6)
    c = run[2].compiled_loss
    assert {b.length for b in c.buckets} == {32}
    assert 1 <= c.graphs == len(c.buckets) <= 4 < 2 * STEPS  # repeated buckets were not compiled again


def test_compiled_with_grad_checkpoint_matches_eager(eager, tmp_path):
    """Activation checkpointing inside the compiled graph: the fixed parity masks need no replay."""
    _assert_close(_train(tmp_path, "aot_eager", grad_checkpoint=True), eager, 1e-5)


def test_compilations_bounded_by_buckets():
    """Ten micro-batches falling into two buckets compile twice; the masks follow the eager
    stream whatever the bucket (a recompilation draws no extra mask)."""
    be = lora_core.get_backend("torch")
    cfg = lora_core.gpt2_config("tiny")
    model = be.build_model(cfg, CFG.lora_config(), base=lora_core.init_gpt2_weights(cfg, 0))
    be.set_compile(model, True, "aot_eager")
    source = NumpyDropout(3)
    be.set_dropout_source(model, source)
    opt = be.AdamW(be.trainable_parameters(model), CFG.adamw_config())
    batches = [collate(_pairs(2, seed=5)), collate([([5] * 20, [7] * 30), ([6] * 10, [8] * 12)])]
    for i in range(10):
        be.train_step(model, opt, [batches[i % 2]], 1e-3)
    c = model.compiled_loss
    assert len(c.buckets) == 2 and c.graphs == 2
    dropping = [m for m in model.modules() if getattr(m, "r", 0) and getattr(m, "p", 0) > 0]
    assert len(dropping) == cfg.n_layer  # c_attn (q and v slices) in every block
    eager_stream = NumpyDropout(3)
    for i in range(10):
        for m in dropping:
            eager_stream.mask((len(batches[i % 2]["token_index"]), m.in_features), m.p)
    assert np.array_equal(eager_stream.rng.random(4), source.rng.random(4))  # the eager stream's position


def test_buckets_policy_and_padding():
    assert [length_bucket(t, 128) for t in (1, 32, 33, 100, 127, 200)] == [32, 32, 64, 128, 128, 200]
    grid = sorted({count_bucket(n) for n in range(1, 200)})
    assert grid[:10] == [16, 20, 24, 28, 32, 40, 48, 56, 64, 80] and len(grid) == 16
    assert all(n <= count_bucket(n) <= max(16, 1.25 * n) for n in range(1, 5000))
    batch = collate(_pairs(3, seed=9))
    shape = bucket_shape(batch, limit=128)
    p = pad_to_bucket(batch, shape)
    n, n_loss = len(batch["token_index"]), len(batch["targets"])
    assert p["input_ids"].shape == (3, shape.length) and len(p["token_index"]) == shape.tokens >= n
    assert np.array_equal(p["input_ids"].reshape(-1)[p["token_index"][:n]], batch["input_ids"].reshape(-1)[batch["token_index"]])
    assert np.array_equal(p["pad_index"][p["token_index"][:n]], np.arange(n))  # real tokens keep their rows
    assert (np.delete(p["pad_index"], p["token_index"][:n]) == shape.tokens).all()  # pads read the zero row
    assert np.array_equal(p["packed_loss_index"][:n_loss], batch["packed_loss_index"]) and p["loss_weight"].sum() == n_loss
    with pytest.raises(ValueError, match="does not fit"):
        pad_to_bucket(batch, shape.__class__(3, shape.length, n - 1, shape.loss))


def test_cli_compile_flag(tmp_path, monkeypatch):
    torch_be, models = lora_core.get_backend("torch"), []
    real = torch_be.set_compile
    monkeypatch.setattr(torch_be, "set_compile", lambda m, enabled=True, backend="inductor": (
        models.append(m), real(m, enabled, backend))[1])
    data = tmp_path / "train.jsonl"
    write_jsonl_atomic(data, [{"context": c, "completion": t} for c, t in _pairs(8)])
    args = ["--backend", "torch", "--recipe", "toy", "--train", str(data), "--random-init", "tiny", "--max-steps", "2",
            "--no-progress", "--out-dir", str(tmp_path / "run"), "--set", "batch_size=4", "log_every=1"]
    assert train_cli.main(args + ["--compile", "aot_eager"]) == 0
    assert len(models) == 1 and models[0].compiled_loss.graphs >= 1 and models[0].compiled_loss.backend == "aot_eager"
    # compile is not part of the run's configuration: a compiled run resumes without it
    assert train_cli.main(args + ["--resume"]) == 0 and len(models) == 1


def test_jittor_refuses_compile():
    jt_be = lora_core.get_backend("jittor")
    cfg = lora_core.gpt2_config("tiny-32")
    model = jt_be.build_model(cfg, CFG.lora_config(), base=lora_core.init_gpt2_weights(cfg, 0))
    with pytest.raises(ValueError, match="jittor"):
        jt_be.set_compile(model, True)
    jt_be.set_compile(model, False)


def test_data_parallel_refuses_compiled_model():
    be = lora_core.get_backend("torch")
    cfg = lora_core.gpt2_config("tiny-32")
    model = be.build_model(cfg, CFG.lora_config(), base=lora_core.init_gpt2_weights(cfg, 0))
    be.set_compile(model, True, "aot_eager")
    with pytest.raises(ValueError, match="one process"):
        be.data_parallel(model)


def _recipe_run_batches(shared_dir, dataset: str):
    """The recipe's training pairs (the shared data, GPT-2 tokens) and the micro-batches of
    its whole run, in the trainer's order (all epochs, ``lora_core.train.data_order``)."""
    from lora_core.data.convert import convert
    from lora_core.data.tokenizer import encode_file, load_tokenizer
    from lora_core.train.data_order import epoch_batches
    from lora_core.train.recipes import RECIPES

    data = shared_dir / "data"
    path = {"e2e": data / "e2e" / "train.txt", "webnlg": data / "webnlg" / "train_formatted.jsonl",
            "dart": data / "dart" / "train_formatted.jsonl"}[dataset]  # fmt: skip
    if not path.is_file():
        pytest.skip(f"shared data missing: {path} (set LORA_SHARED)")
    records = encode_file(load_tokenizer(data / "gpt2-vocab"), convert("e2e" if dataset == "e2e" else "formatted", path))
    pairs = [(r["context"], r["completion"]) for r in records]
    cfg = RECIPES[f"{dataset}-medium"].train
    for epoch in range(cfg.epochs):
        for idx in epoch_batches(len(pairs), cfg.batch_size, cfg.seed, epoch, cfg.last_batch):
            for chunk in np.array_split(idx, min(cfg.grad_accum, len(idx))):
                yield [pairs[i] for i in chunk]


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["dart"])  # e2e and webnlg (fewer buckets, same code): add them here
def test_every_bucket_of_a_recipe_run_compiles(shared_dir, dataset):
    """Issue 25: each paper recipe's whole run (5 epochs at its batch size, on the shared
    training data) meets more buckets than dynamo allows by default (DART at batch 8: 95; the
    fixed limit of 64 before stopped the run there with ``FailOnRecompileLimitHit``, as
    ``fullgraph=True`` does not fall back to eager). From dynamo's default limits, the compiled
    step compiles every bucket once, and the limit follows. The first batch of each bucket is
    run (dynamo's ``eager`` backend, a one-layer GPT-2 with n_positions 1024: the recipe's
    shapes, quickly). DART's run is the one past the old limit; the E2E and WebNLG recipes meet
    fewer buckets through the same code (26 s and 85 s more in a CI-like run; left out of the suite)."""
    import torch

    from lora_core.train.buckets import bucket_shape

    be = lora_core.get_backend("torch")
    cfg = lora_core.gpt2_config("tiny-32", n_layer=1, n_positions=1024, vocab_size=50257)
    model = be.build_model(cfg, CFG.lora_config(), base=lora_core.init_gpt2_weights(cfg, 0))
    shapes = set()
    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256):  # a fresh process's
        be.set_compile(model, True, "eager")
        c = model.compiled_loss
        for examples in _recipe_run_batches(shared_dir, dataset):
            batch = collate(examples, max_len=cfg.n_positions)
            shape = bucket_shape(batch, cfg.n_positions)
            if shape not in shapes:
                shapes.add(shape)
                assert torch.isfinite(c(model.train(), batch))
        limit = torch._dynamo.config.recompile_limit
    print(dataset, "buckets of the run:", len(shapes))
    assert c.graphs == len(c.buckets) == len(shapes) and limit >= len(shapes)
    if dataset == "dart":
        assert len(shapes) > 64, len(shapes)  # past the old limit: the test can fail


@pytest.mark.parametrize("method", ["lora", "full"])
def test_llama_compiled_with_grad_checkpoint_matches_eager(tmp_path, method):
    """A Llama step compiled with activation checkpointing (LoRA on q, v: its frozen MLP is then
    recomputed by the plain checkpoint, dynamo refusing FrozenMLP's pieces; full FT): the eager
    losses. Was: dynamo failed on the heap trim's ctypes lookup of the C library."""
    transformers = pytest.importorskip("transformers")
    import torch

    from lora_core.train.optim import AdamWConfig

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128))  # fmt: skip
    hf.save_pretrained(tmp_path / "llama")
    bk = lora_core.get_backend("torch")
    rng = np.random.default_rng(0)
    batches = [collate([(rng.integers(1, 128, rng.integers(5, 12)).tolist(), rng.integers(1, 128, 5).tolist())
                        for _ in range(4)], max_len=64) for _ in range(3)]  # fmt: skip

    def run(compiled):
        m = bk.from_pretrained(tmp_path / "llama")
        if method == "lora":
            bk.inject_lora(m, lora_core.LoRATargetConfig(r=4, alpha=8.0, seed=1, target_modules=("q_proj", "v_proj")))
        bk.set_grad_checkpoint(m, True)
        if compiled:
            bk.set_compile(m, True, "aot_eager")
        opt = bk.AdamW(bk.trainable_parameters(m), AdamWConfig(weight_decay=0.01))
        return np.array([bk.train_step(m, opt, [b], 1e-2, 0.1, 1.0)["loss"] for b in batches])

    np.testing.assert_allclose(run(True), run(False), rtol=2e-6, atol=0)


def test_compile_refuses_unknown_backends_and_4bit_bases(tmp_path, capsys):
    bk = lora_core.get_backend("torch")
    model = bk.build_model(lora_core.gpt2_config("tiny", vocab_size=64), None,
                           base=lora_core.init_gpt2_weights(lora_core.gpt2_config("tiny", vocab_size=64), 0))  # fmt: skip
    with pytest.raises(ValueError, match="--compile 'nonsense': not a torch.compile backend; choose from"):
        bk.set_compile(model, True, "nonsense")
    for extra, words in ((["--compile", ""], "--compile: give a torch.compile backend"),
                         (["--compile", "aot_eager", "--quantize", "nf4"], "--compile with --quantize nf4 is not supported")):
        with pytest.raises(SystemExit):
            train_cli.main(["--recipe", "toy", "--train", "x", "--valid", "y", "--random-init", "tiny", "--out-dir",
                            str(tmp_path / "o"), *extra])  # fmt: skip
        assert words in capsys.readouterr().err
