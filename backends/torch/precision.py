"""Mixed precision for PyTorch: ``torch.autocast`` around the forward passes (semantics and
loss scaling in ``lora_core.train.precision``; loss scaling runs in ``backends.torch.optim``).

Contract (same in every backend): ``set_precision(model, precision)`` chooses the precision
of ``model``'s forward passes in ``train_step``, ``eval_nll``, ``beam_search`` and the
classification functions (``cls_train_step``, ``cls_eval``, ``cls_predict``)
(``fp32`` leaves them exactly as they are); unsupported combinations raise ``ValueError``.
"""

from __future__ import annotations

import contextlib

import torch

from lora_core.train.precision import check_precision

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def set_precision(model, precision: str = "fp32") -> None:
    """Run ``model``'s forward passes under ``torch.autocast`` in ``precision`` (bf16, fp16) or
    unchanged in float32 (fp32); parameters stay float32."""
    model.precision = check_precision(precision)


def autocast(model):
    """The autocast context of ``model``'s precision on its parameters' device (none for fp32)."""
    precision = getattr(model, "precision", "fp32")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(next(model.parameters()).device.type, dtype=DTYPES[precision])


__all__ = ["set_precision"]
