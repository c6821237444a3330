"""Loss and training step for PyTorch; semantics in ``lora_core.data.batching`` and ``lora_core.train.optim``.

Contract (same in every backend): ``lm_loss(model, batch, label_smooth) -> scalar``;
``train_step(model, optimizer, micro_batches, lr, label_smooth, max_grad_norm) -> dict``;
``eval_nll(model, batch) -> (nll_sum, n)``. Forward passes run in the model's precision
(``set_precision``); the loss is computed in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .precision import autocast


def _gather_hidden(model, batch):
    h = model.hidden_unpadded(batch["input_ids"], batch["token_index"], batch["pad_index"])  # (N, E) real tokens
    dev = h.device
    h = h.index_select(0, torch.from_numpy(batch["packed_loss_index"]).to(dev))  # loss positions only
    return model.lm_logits(h), torch.from_numpy(batch["targets"]).to(dev)


def manual_seed(seed: int) -> None:
    """Seed the framework RNG (dropout masks); the trainer reseeds per step for exact resume."""
    torch.manual_seed(seed)


def _token_nll(logits: torch.Tensor, targets: torch.Tensor, label_smooth: float = 0.0) -> torch.Tensor:
    """Per position ``(1-eps)*NLL + eps*mean(-log p)``, in float32."""
    logp = F.log_softmax(logits.float(), dim=-1)  # a no-op in fp32
    nll = -logp.gather(1, targets[:, None]).squeeze(1)
    if label_smooth > 0:
        nll = (1.0 - label_smooth) * nll + label_smooth * (-logp.mean(dim=-1))
    return nll


def lm_loss(model, batch: dict, label_smooth: float = 0.0) -> torch.Tensor:
    """Mean over loss positions of ``(1-eps)*NLL + eps*mean(-log p)`` (LM head only there)."""
    logits, targets = _gather_hidden(model, batch)
    return _token_nll(logits, targets, label_smooth).mean()


def train_step(model, optimizer, micro_batches: list[dict], lr: float, label_smooth: float = 0.0,
               max_grad_norm: float = 0.0) -> dict:
    """One optimizer update over ``micro_batches`` (gradient accumulation: each micro-batch
    loss is divided by their number, as the paper code does); after ``set_compile`` each
    micro-batch's forward pass and loss run compiled. Returns loss and grad norm."""
    model.train()
    total = 0.0
    compiled = getattr(model, "compiled_loss", None)  # set_compile
    for mb in micro_batches:
        if compiled is not None:
            loss = compiled(model, mb, label_smooth)
        else:
            with autocast(model):
                loss = lm_loss(model, mb, label_smooth)
        optimizer.backward(loss, 1.0 / len(micro_batches))
        total += loss.item()
    norm = optimizer.clip_grad_norm(max_grad_norm) if max_grad_norm > 0 else float("nan")
    optimizer.step(lr)
    return {"loss": total / len(micro_batches), "grad_norm": norm}


@torch.no_grad()
def eval_nll(model, batch: dict) -> tuple[float, int]:
    """Summed NLL over the loss positions and their count (for perplexity)."""
    model.eval()
    with autocast(model):
        logits, targets = _gather_hidden(model, batch)
    return F.cross_entropy(logits.float(), targets, reduction="sum").item(), int(targets.numel())
