"""Bytes per parameter of fp32 weights, bf16 autocast and bf16 weights + fp32 masters (train.master_weights).

Weights + gradients + optimizer state (AdamW, masters included) measured as tensor bytes after one step and
a backward, beside `lmforge estimate`'s rows for the same config and its autocast weight-copy row (held from
forward to backward, not a persistent tensor). Run: PYTHONPATH=src python bench/master_weights_memory.py
"""

from __future__ import annotations

import torch

from lmforge.config.schema import Config
from lmforge.engine.loss import token_loss_sum
from lmforge.engine.precision import Precision
from lmforge.engine.step import train_step
from lmforge.models import build_model
from lmforge.optim.builder import build_optimizer
from lmforge.optim.master import keep_masters, lower_weights
from lmforge.tools.estimate import estimate

MODEL = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32,
             tie_embeddings=False)


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (4, 32), generator=g), torch.randint(0, 128, (4, 32), generator=g)


def main() -> None:
    cpu = torch.device("cpu")
    print("| mode | measured bytes / parameter | estimator | autocast copies |\n|---|---|---|---|")
    for name, train in (("fp32", {"precision": "fp32"}), ("bf16 autocast", {"precision": "bf16"}),
                        ("bf16 + fp32 master", {"precision": "bf16", "master_weights": "fp32"})):
        cfg = Config.model_validate({"model": MODEL, "optim": {"lr": 1e-3},
                                     "train": {"micro_batch_size": 4, "seq_len": 32, **train}})
        torch.manual_seed(0)
        model = build_model(cfg.model)
        masters = lower_weights(model) if cfg.train.master_weights == "fp32" else None
        opt = build_optimizer(model, cfg.optim)
        if masters is not None:
            keep_masters(opt, masters)
        prec = Precision(cfg.train.precision, cpu)
        train_step(model, [batch(0)], opt, prec, grad_clip=0.0)
        x, y = batch(1)
        with prec.autocast():
            token_loss_sum(model(x), y).backward()
        n = sum(p.numel() for p in model.parameters())
        measured = (sum(p.nbytes + p.grad.nbytes for p in model.parameters())
                    + sum(v.nbytes for st in opt.state.values() for v in st.values() if torch.is_tensor(v)))
        rows = estimate(cfg).rows
        est = sum(v for k, v in rows.items() if k.startswith(("parameters", "gradients", "optimizer")))
        copies = rows.get("bf16/fp16 weight copies (autocast)", 0)
        print(f"| {name} | {measured / n:.2f} | {est / n:.2f} | {copies / n:.2f} |")


if __name__ == "__main__":
    main()
