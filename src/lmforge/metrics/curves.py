"""A run's curves as a PNG: train/val loss and lr against step, from its metrics.jsonl (redrawn at
every checkpoint and at the end of training)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from lmforge.metrics.loggers import read_metrics
from lmforge.utils.io import check_replaceable


def plot_curves(metrics_path: str | os.PathLike, out_path: str | os.PathLike, title: str = "") -> Path | None:
    """Draw train/val loss (top; an RL run's mean reward instead) and learning rate (bottom) against
    step. None if nothing to draw."""
    records = read_metrics(metrics_path)
    train = [r for r in records if "loss" in r and "event" not in r]
    val = [r for r in records if "val_loss" in r]
    if not train and not val:
        return None
    plt = pyplot()
    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                         gridspec_kw={"height_ratios": [3, 1]})
    # An RL run's loss says little (its mean is ~0 by construction): its curve is the reward.
    key, what = ("reward", "reward") if any("reward" in r for r in train) else ("loss", "loss")
    if train:
        ax_loss.plot([r["step"] for r in train], [r[key] for r in train], label=f"train {what}", lw=1.2)
        ax_lr.plot([r["step"] for r in train], [r["lr"] for r in train], color="tab:green", lw=1.2)
    if val:
        shown = [r for r in val if f"val_{key}" in r]
        ax_loss.plot([r["step"] for r in shown], [r[f"val_{key}"] for r in shown], "o-", color="tab:orange",
                     label=f"val {what}" + (" (greedy)" if key == "reward" else ""), ms=4)
    for kind, color in (("ema", "tab:purple"), ("swa", "tab:brown")):
        avg = [r for r in val if f"val_loss_{kind}" in r]
        if avg:
            ax_loss.plot([r["step"] for r in avg], [r[f"val_loss_{kind}"] for r in avg], "s--",
                         label=f"val loss ({kind})", color=color, ms=3)
    for i, r in enumerate(r for r in records if r.get("event") in ("loss_spike", "nonfinite")):
        ax_loss.axvline(r.get("spike_step", r["step"]), color="tab:red", alpha=0.4, lw=1,
                        label="loss spike / non-finite" if i == 0 else None)
    ax_loss.set_ylabel("mean reward" if key == "reward" else "loss (nats/token)")
    ax_loss.set_title(title)
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    ax_lr.set_ylabel("lr")
    ax_lr.set_xlabel("step")
    ax_lr.grid(alpha=0.3)
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    return save_figure(fig, out_path)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, out_path: str | os.PathLike) -> Path:
    """Write `fig` atomically (a reader never sees half a PNG) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        out = check_replaceable(out_path)
    except BaseException:
        plt.close(fig)
        raise
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".png", dir=out.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the plot from other users
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
