"""Loss and training step for PyTorch; semantics in ``lora_core.data.batching`` and ``lora_core.train.optim``.

Contract (same in every backend): ``lm_loss(model, batch, label_smooth) -> scalar``;
``train_step(model, optimizer, micro_batches, lr, label_smooth, max_grad_norm) -> dict``;
``eval_nll(model, batch) -> (nll_sum, n)``. Forward passes run in the model's precision
(``set_precision``); the loss is computed in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lora_core.data.batching import check_token_ids
from lora_core.train import heap

from .precision import autocast


def _loss_hidden(model, batch):
    """Final hidden states at the loss positions (M, E) and their targets (M,). Every target must
    be a token of the vocabulary (checked on the host array, ``check_token_ids``; the input ids
    in ``hidden_unpadded``): ValueError naming it, as in every backend."""
    targets = check_token_ids(batch["targets"], model.config.vocab_size, "targets")
    h = model.hidden_unpadded(batch["input_ids"], batch["token_index"], batch["pad_index"])  # (N, E) real tokens
    dev = h.device
    h = h.index_select(0, torch.from_numpy(batch["packed_loss_index"]).to(dev))  # loss positions only
    return h, torch.from_numpy(targets).to(dev)


def _gather_hidden(model, batch):
    h, targets = _loss_hidden(model, batch)
    return model.lm_logits(h), targets


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


class _HeadNLL(torch.autograd.Function):
    """``_token_nll(h @ w.T, targets, eps)`` for a frozen head ``w`` (V, E), whose (rows, V) logits
    live only inside this forward, ``rows`` loss positions at a time (``heap.head_piece_rows``: just
    over 32 MB of float32 logits on the CPU, glibc's mmap ceiling; 256 MB in 64-row panels on a
    GPU): each piece's input gradient is computed here at once (its logits overwritten in place by
    ``softmax - (1-eps) onehot - eps/V``, then multiplied by ``w``) and kept, (N, E), for the
    backward pass, scaled there per position. The plain path keeps the log-probabilities from the
    forward pass to the backward one and adds two more (N, V) tensors there (the gradients of the
    log-probabilities and of the logits): at Llama 3's 128k vocabulary and 256 tokens each is 131
    MB, at 4 x 512 tokens 1 GB, where a piece is 32 MB. The same products, in pieces of rows, so the
    same time; where V is not a multiple of ``heap.HEAD_COLUMN_MULTIPLE`` (GPT-2's 50257) each
    piece's logits are two products, ``w``'s first ``heap.head_column_split(V)`` rows (a view) and
    the rest, which the CPU's GEMM runs faster than one product of V columns. A target outside
    ``[0, V)`` is refused (ValueError, ``check_token_ids``), never clamped into a column: ``lm_loss``
    checks the host array before the forward pass; here a CPU tensor is checked again (free), a
    GPU one is not (that would wait for the device)."""

    @staticmethod
    def forward(ctx, h, w, targets, label_smooth, rows):
        n = h.shape[0]
        vocab = w.shape[0]
        if targets.device.type == "cpu":
            check_token_ids(targets.numpy(), vocab, "targets")
        split = heap.head_column_split(vocab)
        parts = [(0, w)] if split == vocab else [(0, w[:split]), (split, w[split:])]  # (first column, rows of w)
        eps = float(label_smooth)
        nll = torch.empty(n, dtype=torch.float32, device=h.device)
        grad = torch.empty_like(h)
        for a in range(0, n, rows):
            x_in = h[a : a + rows]
            t = targets[a : a + rows]
            # the logits themselves in fp32 (F.linear under autocast casts as the head's product would)
            xs = [F.linear(x_in, wp).float() for _, wp in parts]
            # per part: which positions' targets it holds, and their column in it (clamped for the targets
            # the other part holds; every target is in one part, checked above)
            where = [((t >= c0) & (t < c0 + wp.shape[0]), (t - c0).clamp(0, wp.shape[0] - 1)[:, None]) for c0, wp in parts]
            picked = None  # each position's target logit, from the part that holds its column
            for x, (inside, col) in zip(xs, where):
                val = x.gather(1, col).squeeze(1)
                picked = torch.where(inside, val, 0.0 if picked is None else picked)
            piece = picked.neg_()
            if eps > 0:
                piece = (1.0 - eps) * piece - eps * (sum(x.sum(dim=-1) for x in xs) / vocab)
            top = xs[0].amax(dim=-1, keepdim=True)
            for x in xs[1:]:
                top = torch.maximum(top, x.amax(dim=-1, keepdim=True))
            total = None
            for x in xs:
                s = x.sub_(top).exp_().sum(dim=-1, keepdim=True)
                total = s if total is None else total + s
            nll[a : a + rows] = piece + (top + total.log()).squeeze(1)  # log-sum-exp: (1-eps) + eps of it
            g = None
            for (_, wp), x, (inside, col) in zip(parts, xs, where):
                x.div_(total)  # softmax
                if eps > 0:
                    x.sub_(eps / vocab)
                x.scatter_add_(1, col, torch.where(inside, eps - 1.0, 0.0)[:, None].to(x.dtype))
                p = torch.mm(x.to(wp.dtype), wp)  # the input gradient of this part's product
                g = p if g is None else g.float().add_(p)  # the few columns' part added in fp32
            grad[a : a + rows] = g
            del xs, x, g  # this piece's (rows, V) tensors gone before the next one's
        ctx.save_for_backward(grad)
        return nll

    @staticmethod
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        return grad * g[:, None].to(grad.dtype), None, None, None, None


def _head_trains(model, h) -> bool:
    """Whether the LM head has a trainable parameter (full FT's embedding, LoRA on it): read off
    a zero-row product's graph (outside autocast, which would cast the whole head for it)."""
    with torch.enable_grad(), torch.autocast(h.device.type, enabled=False):
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())  # the embedding's, the head's
        return model.lm_logits(h[:0].detach().to(dtype)).requires_grad


def _frozen_head(model, h):
    """The frozen head's (V, E) weight for ``_HeadNLL``: ``model.head_weight()``, under autocast
    cast to the autocast dtype once. Autocast caches the casts of trained weights only and casts a
    frozen one again at every product: once per piece, each time the whole (V, E) matrix (1 GB at
    Llama 3's vocabulary and 2048 hidden, in float32)."""
    dev = h.device.type
    w = model.head_weight().detach()
    return w.to(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else w


def lm_loss(model, batch: dict, label_smooth: float = 0.0) -> torch.Tensor:
    """Mean over loss positions of ``(1-eps)*NLL + eps*mean(-log p)`` (LM head only there);
    with a frozen head whose logits take ``heap.HEAD_FUSED_MIN_BYTES`` or more, no (N, V)
    tensor is kept for the backward pass and the logits are taken in pieces (``_HeadNLL``)."""
    h, targets = _loss_hidden(model, batch)
    vocab = model.config.vocab_size
    big = h.shape[0] * vocab * 4 >= heap.HEAD_FUSED_MIN_BYTES
    if big and torch.is_grad_enabled() and h.requires_grad and not _head_trains(model, h):
        rows = heap.head_piece_rows(h.shape[0], vocab, h.device.type)
        return _HeadNLL.apply(h, _frozen_head(model, h), targets, label_smooth, rows).mean()
    return _token_nll(model.lm_logits(h), targets, label_smooth).mean()


def train_step(model, optimizer, micro_batches: list[dict], lr: float, label_smooth: float = 0.0,
               max_grad_norm: float = 0.0) -> dict:
    """One optimizer update over ``micro_batches`` (gradient accumulation: each micro-batch
    loss is divided by their number, as the paper code does); after ``set_compile`` each
    micro-batch's forward pass and loss run compiled. Returns loss and grad norm. The losses
    are read back after the update is issued (on a GPU the host then queues the update while the
    backward pass runs, not after it), summed in the same order."""
    if not model.training:  # (train() sets every module's flag: ~300 attribute sets a step)
        model.train()
    losses = []
    compiled = getattr(model, "compiled_loss", None)  # set_compile
    for mb in micro_batches:
        if compiled is not None:
            loss = compiled(model, mb, label_smooth)
        else:
            with autocast(model):
                loss = lm_loss(model, mb, label_smooth)
        optimizer.backward(loss, 1.0 / len(micro_batches))
        losses.append(loss.detach())
    norm = optimizer.clip_grad_norm(max_grad_norm) if max_grad_norm > 0 else float("nan")
    optimizer.step(lr)
    return {"loss": sum(loss.item() for loss in losses) / len(micro_batches), "grad_norm": norm}


@torch.no_grad()
def eval_nll(model, batch: dict) -> tuple[float, int]:
    """Summed NLL over the loss positions and their count (for perplexity)."""
    model.eval()
    with autocast(model):
        logits, targets = _gather_hidden(model, batch)
    return F.cross_entropy(logits.float(), targets, reduction="sum").item(), int(targets.numel())
