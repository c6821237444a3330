"""Draw training-loss curves (and validation NLL when logged) from one or more ``log.jsonl``.

    python -m examples.nlg.plot runs/toy-torch/log.jsonl runs/toy-jittor/log.jsonl \\
        --labels torch jittor --out curves.png

The logs are those ``lora_core.train.trainer`` writes (``kind`` ``train`` lines with ``step``,
``loss``, ``avg_loss``; ``eval`` lines with ``valid_nll``). Curves are overlaid, so two
backends trained from the same weights and data order should draw one line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lora_core.train.trainer import read_log

from ..run_options import doc_summary


def _series(records: list[dict], kind: str, key: str) -> tuple[list[int], list[float]]:
    pts = sorted({r["step"]: r[key] for r in records if r.get("kind") == kind and r.get(key) is not None}.items())
    return [s for s, _ in pts], [v for _, v in pts]


# validation figures a log may hold (LM: NLL; classification: accuracy), the first found is drawn
EVAL_METRICS = (("valid_nll", "NLL per completion token", "validation NLL"),
                ("valid_accuracy", "accuracy", "validation accuracy"))  # fmt: skip


def plot(logs: list[Path], labels: list[str], out: Path, title: str | None = None) -> Path:
    """Write the figure to ``out``: training loss per step (left) and the validation figure
    (right, only when a log has ``eval`` lines: NLL, or accuracy for classification)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(label, read_log(path)) for label, path in zip(labels, logs, strict=True)]
    found = [m for m in EVAL_METRICS if any(_series(recs, "eval", m[0])[0] for _, recs in runs)]
    has_eval = bool(found)
    fig, axes = plt.subplots(1, 2 if has_eval else 1, figsize=(12 if has_eval else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    styles = ["-", "--", ":", "-."]
    for i, (label, recs) in enumerate(runs):
        steps, loss = _series(recs, "train", "loss")
        ax.plot(steps, loss, styles[i % len(styles)], lw=1.4, label=label)
    ax.set(xlabel="optimizer step", ylabel="training loss", title="training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    if has_eval:
        ax = axes[0][1]
        key, ylabel, name = found[0]
        for i, (label, recs) in enumerate(runs):
            steps, values = _series(recs, "eval", key)
            ax.plot(steps, values, styles[i % len(styles)], marker="o", ms=4, lw=1.4, label=label)
        ax.set(xlabel="optimizer step", ylabel=ylabel, title=name)
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.nlg.plot", description=doc_summary(__doc__))
    parser.add_argument("logs", nargs="+", type=Path, metavar="LOG.jsonl")
    parser.add_argument("--out", type=Path, required=True, help="PNG file to write")
    parser.add_argument("--labels", nargs="+", help="one per log (default: the log's folder name)")
    parser.add_argument("--title")
    args = parser.parse_args(argv)
    labels = args.labels or [p.parent.name or p.stem for p in args.logs]
    if len(labels) != len(args.logs):
        parser.error(f"{len(args.logs)} logs but {len(labels)} labels")
    try:
        plot(args.logs, labels, args.out, args.title)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
