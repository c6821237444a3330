"""Sequence-classification loss, training step and prediction for Jittor; contract in
``backends.torch.classify``."""

from __future__ import annotations

import jittor as jt
import numpy as np

from lora_core.data.batching import check_token_ids

from .train import log_softmax


def _logits(model, batch: dict) -> jt.Var:
    ids = check_token_ids(batch["input_ids"], model.config.vocab_size, "input ids")  # jittor's lookup checks nothing
    return model(jt.array(ids), jt.array(batch["attention_mask"]))


def cls_loss(model, batch: dict):
    """Mean cross-entropy of the batch's labels."""
    logp = log_softmax(_logits(model, batch))
    return -logp.gather(1, jt.array(batch["labels"]).reshape(-1, 1)).mean()


def cls_train_step(model, optimizer, micro_batches: list, lr: float, max_grad_norm: float = 0.0) -> dict:
    """One optimizer update over ``micro_batches``."""
    model.train()
    total = 0.0
    for mb in micro_batches:
        loss = cls_loss(model, mb)
        optimizer.backward(loss, 1.0 / len(micro_batches))
        total += float(loss.item())
    norm = optimizer.clip_grad_norm(max_grad_norm) if max_grad_norm > 0 else float("nan")
    optimizer.step(lr)
    return {"loss": total / len(micro_batches), "grad_norm": norm}


def cls_predict(model, batch: dict) -> np.ndarray:
    """Predicted labels (argmax of the logits), (B,) int64."""
    model.eval()
    with jt.no_grad():
        return _logits(model, batch).numpy().argmax(-1).astype(np.int64)


def cls_eval(model, batch: dict) -> tuple[float, np.ndarray]:
    """Summed cross-entropy of the batch's labels and the predicted labels (evaluation mode)."""
    model.eval()
    with jt.no_grad():
        logits = _logits(model, batch)
        logp = log_softmax(logits)
        loss = -logp.gather(1, jt.array(batch["labels"]).reshape(-1, 1)).sum()
        return float(loss.item()), logits.numpy().argmax(-1).astype(np.int64)


__all__ = ["cls_eval", "cls_loss", "cls_predict", "cls_train_step"]
