"""Sequence-classification loss, training step and prediction for PyTorch.

Contract (same in every backend): a batch is a dict of numpy arrays ``input_ids`` (B, T),
``attention_mask`` (B, T) and, for training, ``labels`` (B,) (``lora_core.data.cls_data``);
``cls_loss(model, batch) -> scalar`` (mean cross-entropy); ``cls_train_step(model,
optimizer, micro_batches, lr, max_grad_norm) -> dict`` (as ``train_step``: gradient
accumulation divides each micro-batch loss by their number); ``cls_predict(model, batch)
-> (B,) numpy labels``; ``cls_eval(model, batch) -> (summed cross-entropy, (B,) labels)``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from lora_core.data.batching import check_token_ids

from .precision import autocast


def _logits(model, batch: dict) -> torch.Tensor:
    """float32 logits; the forward runs in the model's precision (``set_precision``)."""
    dev = next(model.parameters()).device
    ids = check_token_ids(batch["input_ids"], model.config.vocab_size, "input ids")  # as every backend
    with autocast(model):
        logits = model(torch.from_numpy(ids).to(dev), torch.from_numpy(batch["attention_mask"]).to(dev))
    return logits.float()  # a no-op in fp32


def cls_loss(model, batch: dict) -> torch.Tensor:
    """Mean cross-entropy of the batch's labels."""
    logits = _logits(model, batch)
    return F.cross_entropy(logits, torch.from_numpy(batch["labels"]).to(logits.device))


def cls_train_step(model, optimizer, micro_batches: list[dict], lr: float, max_grad_norm: float = 0.0) -> dict:
    """One optimizer update over ``micro_batches``. Returns loss and grad norm."""
    model.train()
    total = 0.0
    for mb in micro_batches:
        loss = cls_loss(model, mb)
        optimizer.backward(loss, 1.0 / len(micro_batches))
        total += loss.item()
    norm = optimizer.clip_grad_norm(max_grad_norm) if max_grad_norm > 0 else float("nan")
    optimizer.step(lr)
    return {"loss": total / len(micro_batches), "grad_norm": norm}


@torch.no_grad()
def cls_predict(model, batch: dict) -> np.ndarray:
    """Predicted labels (argmax of the logits), (B,) int64."""
    model.eval()
    return _logits(model, batch).argmax(dim=-1).cpu().numpy().astype(np.int64)


@torch.no_grad()
def cls_eval(model, batch: dict) -> tuple[float, np.ndarray]:
    """Summed cross-entropy of the batch's labels and the predicted labels (evaluation mode)."""
    model.eval()
    logits = _logits(model, batch)
    loss = F.cross_entropy(logits, torch.from_numpy(batch["labels"]).to(logits.device), reduction="sum")
    return float(loss.item()), logits.argmax(dim=-1).cpu().numpy().astype(np.int64)


__all__ = ["cls_eval", "cls_loss", "cls_predict", "cls_train_step"]
