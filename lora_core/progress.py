"""Progress bars (tqdm) over batches of work."""

from __future__ import annotations

from collections.abc import Iterator, Sequence


def batched(items: Sequence, size: int, progress: bool = False, desc: str = "") -> Iterator[Sequence]:
    """Consecutive slices of ``items`` of length ``size`` (the last may be shorter)."""
    if size < 1:
        raise ValueError(f"batch size must be >= 1, got {size}")
    starts = range(0, len(items), size)
    if progress:
        from tqdm import tqdm
        starts = tqdm(starts, desc=desc, unit="batch", total=len(starts))
    for s in starts:
        yield items[s:s + size]


def step_bar(total: int, initial: int, desc: str, enabled: bool = True):
    """A tqdm bar over ``total`` optimizer updates, starting at ``initial`` (a resumed run)."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", disable=not enabled, dynamic_ncols=True,
                mininterval=0.5)
