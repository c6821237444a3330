"""What activation checkpointing recomputes of a Llama layer whose MLP is frozen, and in what
pieces (the torch backend's ``FrozenMLP``; the planner's GC activations).

With LoRA on q, k, v, o (the studies' targets) the MLP's three projections are frozen: the
backward pass needs only their input gradients, and the MLP's input gradient of a token depends
on that token alone. So under checkpointing the layer keeps, of its MLP, only its (normed) input;
the backward pass recomputes ``gate`` and ``up`` and takes their gradients ``rows`` tokens at a
time (:func:`mlp_chunk_rows`), so that no (tokens, intermediate) tensor of the whole batch is ever
alive: at llama-bench's widths and 4 x 512 tokens, each of them is 23 MB and the plain
recomputation held about six at once (gate, up, the gradient of down's input, SwiGLU's products
and both input gradients), the peak of the step. The same products as before (gate and up
recomputed once, down's input gradient, gate's and up's input gradients), in pieces.
"""

from __future__ import annotations

from .heap import PIECE_DEVICES, panel_rows

# the largest (rows, intermediate) piece of the MLP's backward pass under checkpointing, and of its
# forward pass (larger: a piece's GEMMs pack the weights again, and the forward pass keeps fewer
# such tensors alive at once; pieces of 4 MB there took a LoRA+GC step 2% longer on llama-bench)
MLP_CHUNK_BYTES = 4 << 20
MLP_FORWARD_CHUNK_BYTES = 16 << 20


def mlp_chunk_rows(tokens: int, ffn: int, itemsize: int = 4, forward: bool = False, device: str = "cpu") -> int:
    """Tokens per piece of a frozen MLP's recomputed backward pass (``forward``: of its forward
    pass): the most whose (rows, ffn) tensors of ``itemsize`` bytes fit ``MLP_CHUNK_BYTES``
    (``MLP_FORWARD_CHUNK_BYTES``), a multiple of 64 (at least 64), at most ``tokens``.
    llama-bench (ffn 2816, float32): 320 (forward 1472); Llama-3.2-1B/3B (8192): 128 (512).
    On a ``device`` not in ``heap.PIECE_DEVICES`` (a GPU), ``tokens``: one piece."""
    if tokens < 1 or ffn < 1 or itemsize < 1:
        raise ValueError(f"mlp_chunk_rows needs positive sizes, got tokens={tokens}, ffn={ffn}, itemsize={itemsize}")
    if device not in PIECE_DEVICES:
        return tokens
    limit = MLP_FORWARD_CHUNK_BYTES if forward else MLP_CHUNK_BYTES
    return min(panel_rows(limit, ffn * itemsize), tokens)
