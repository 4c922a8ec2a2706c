"""Loss / lr curves of a run as a PNG, from its metrics.jsonl."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from lmforge.metrics.loggers import read_metrics


def plot_curves(metrics_path: str | os.PathLike, out_path: str | os.PathLike, title: str = "") -> Path | None:
    """Draw train/val loss (top) and learning rate (bottom) against step. None if nothing to draw."""
    records = read_metrics(metrics_path)
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    if not train and not val:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                         gridspec_kw={"height_ratios": [3, 1]})
    if train:
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", lw=1.2)
        ax_lr.plot([r["step"] for r in train], [r["lr"] for r in train], color="tab:green", lw=1.2)
    if val:
        ax_loss.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val loss",
                     color="tab:orange", ms=4)
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.set_title(title)
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    ax_lr.set_ylabel("lr")
    ax_lr.set_xlabel("step")
    ax_lr.grid(alpha=0.3)
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    fig.tight_layout()
    out = Path(out_path)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".png", dir=out.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
