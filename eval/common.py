"""Small helpers shared by the E2E and WebNLG/DART scorers."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .inputs import EvalInputError

__all__ = ["select_metrics", "per_instance_rows", "check_instances"]


def select_metrics(metrics: Iterable[str] | str | None, allowed: Sequence[str]) -> list[str]:
    """The requested metrics in official order; ValueError naming the valid ones.

    Args:
        metrics: names (case-insensitive; a comma-separated string is accepted), or
            None for all of ``allowed``.
        allowed: the scorer's metrics in their official order.
    """
    if metrics is None:
        return list(allowed)
    if isinstance(metrics, str):
        metrics = [m for m in metrics.split(",") if m.strip()]
    lookup = {a.lower(): a for a in allowed}
    chosen = set()
    for m in metrics:
        key = m.strip().lower()
        if key not in lookup:
            raise ValueError(f"unknown metric {m!r}; choose from {', '.join(allowed)}")
        chosen.add(lookup[key])
    if not chosen:
        raise ValueError(f"no metric requested; choose from {', '.join(allowed)}")
    return [a for a in allowed if a in chosen]


def per_instance_rows(n: int, columns: dict[str, Sequence]) -> list[dict]:
    """``[{"index": i, metric: value, ...}, ...]`` from per-metric columns of length n."""
    return [{"index": i, **{k: v[i] for k, v in columns.items()}} for i in range(n)]


def check_instances(hyps: Sequence[str], refs: Sequence[Sequence[str]], what: str) -> None:
    """EvalInputError unless there is at least one instance and the counts agree.

    Args:
        hyps: hypotheses.
        refs: references per instance.
        what: name of the data set, for messages.
    """
    if len(hyps) != len(refs):
        raise EvalInputError(f"{what}: {len(hyps)} hypotheses but {len(refs)} reference sets")
    if not hyps:
        raise EvalInputError(f"{what}: no instances to score")
