"""Loss and training step for Jittor; contract and semantics in ``backends.torch.train``."""

from __future__ import annotations

import jittor as jt

from lora_core.data.batching import check_token_ids


def log_softmax(x: jt.Var) -> jt.Var:
    """Stable log-softmax over the last axis. (``jittor.nn.log_softmax`` is ``log(softmax)``,
    whose backward divides by the probabilities: measured 3e-5 relative gradient error.)"""
    z = x - x.max(dim=-1, keepdims=True).stop_grad()
    return z - jt.log(jt.exp(z).sum(dim=-1, keepdims=True))


def _gather_logits(model, batch):
    # every target a token of the vocabulary (the input ids: hidden_unpadded), checked on the host
    # array: jittor's gather reads out of bounds silently (as torch's _loss_hidden)
    targets = check_token_ids(batch["targets"], model.config.vocab_size, "targets")
    h = model.hidden_unpadded(batch["input_ids"], batch["token_index"], batch["pad_index"])  # (N, E) real tokens
    h = h[jt.array(batch["packed_loss_index"])]  # loss positions only
    return model.lm_logits(h), jt.array(targets)


def manual_seed(seed: int) -> None:
    """Seed the framework RNG (dropout masks); the trainer reseeds per step for exact resume.
    ``jt.set_global_seed`` takes only ``[0, 2**32)``, where torch takes any 64-bit seed (the
    trainer's ``dropout_seed(seed, step) * world + rank`` passes 2**32 from ``--seed 4295`` on):
    the seed is reduced modulo 2**32 here (negative ones too), so every seed torch accepts
    works; seeds equal modulo 2**32 give the same draws."""
    jt.set_global_seed(int(seed) % (1 << 32))


def lm_loss(model, batch: dict, label_smooth: float = 0.0):
    """Mean over loss positions of ``(1-eps)*NLL + eps*mean(-log p)``."""
    logits, targets = _gather_logits(model, batch)
    logp = log_softmax(logits)
    nll = -logp.gather(1, targets.reshape(-1, 1)).reshape(-1)
    if label_smooth > 0:
        nll = (1.0 - label_smooth) * nll + label_smooth * (-logp.mean(dim=-1))
    return nll.mean()


def train_step(model, optimizer, micro_batches: list, lr: float, label_smooth: float = 0.0,
               max_grad_norm: float = 0.0) -> dict:
    """One optimizer update over ``micro_batches`` (gradient accumulation)."""
    model.train()
    total = 0.0
    for mb in micro_batches:
        loss = lm_loss(model, mb, label_smooth)
        optimizer.backward(loss, 1.0 / len(micro_batches))
        total += float(loss.item())
    norm = optimizer.clip_grad_norm(max_grad_norm) if max_grad_norm > 0 else float("nan")
    optimizer.step(lr)
    return {"loss": total / len(micro_batches), "grad_norm": norm}


def eval_nll(model, batch: dict) -> tuple[float, int]:
    """Summed NLL over the loss positions and their count."""
    model.eval()
    with jt.no_grad():
        logits, targets = _gather_logits(model, batch)
        logp = log_softmax(logits)
        nll = -logp.gather(1, targets.reshape(-1, 1)).sum()
        return float(nll.item()), int(targets.shape[0])
