"""The `finetune` section applied to a model: nothing (full fine-tuning), LoRA or DoRA adapters on a
frozen base, or QLoRA (the base's block linears in NF4 with double quantisation, adapters on top).

Applied after the base weights are loaded and before the model is parallelised and the optimizer is
built, so the optimizer holds the adapters only; the same call on a freshly built model gives the
structure a fine-tuned checkpoint loads into (`load_finetuned`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lmforge.config.schema import Config, FinetuneConfig
from lmforge.errors import ConfigError, LmforgeError
from lmforge.finetune.lora import apply_lora, lora_layers, merge_lora
from lmforge.finetune.nf4 import in_layers, quantize_model_nf4
from lmforge.finetune.t5_lora import block_linear, is_t5
from lmforge.finetune.token_rows import fold_token_rows, train_token_rows


@dataclass
class FinetuneSummary:
    method: str
    trainable: int
    total: int
    wrapped: list[str] = field(default_factory=list)
    quant: dict | None = None  # qlora: quantize_model_nf4's stats

    def line(self) -> str:
        if self.method == "full":
            return f"full fine-tuning: {self.trainable / 1e6:.2f}M trainable parameters"
        text = (
            f"{self.method}: adapters on {len(self.wrapped)} linear layers, {self.trainable:,} trainable "
            f"parameters ({100 * self.trainable / max(self.total, 1):.2f}% of {self.total:,})"
        )
        if self.quant:
            text += (
                f"; base in NF4: {self.quant['params']:,} weights at {self.quant['bytes_per_param']:.4f} "
                f"bytes each ({self.quant['compression']:.1f}x smaller than fp32)"
            )
        return text


def apply_finetune(model: nn.Module, cfg: FinetuneConfig, seed: int = 0) -> FinetuneSummary:
    """Make `model` (materialised, weights loaded) train the way `cfg.method` says."""
    method = cfg.method
    total = sum(p.numel() for p in model.parameters())
    if method == "full":
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return FinetuneSummary(method, trainable, total)
    if not (hasattr(model, "layers") or is_t5(model)):  # T5: its two stacks' blocks (t5_lora.py)
        raise ConfigError(
            f"finetune.method={method} adds adapters to lmforge's Transformer; a model object of "
            "your own takes finetune.method=full (or add lmforge.finetune.apply_lora yourself)"
        )
    quant = None
    if method == "qlora":
        quant = quantize_model_nf4(model, block_linear if is_t5(model) else in_layers,
                                   blocksize=cfg.quant_blocksize, double_quant=True)
    if cfg.init_adapter:
        wrapped = _load_adapter(model, cfg)
        train_token_rows(model, cfg.train_tokens)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
        return FinetuneSummary(method, trainable, total, wrapped, quant)
    wrapped = apply_lora(
        model,
        cfg.targets,
        r=cfg.r,
        alpha=cfg.alpha,
        dropout=cfg.dropout,
        rslora=cfg.rslora,
        dora=method == "dora",
        seed=seed,
    )
    train_token_rows(model, cfg.train_tokens)  # after apply_lora, which freezes everything else
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    return FinetuneSummary(method, trainable, total, wrapped, quant)


def _load_adapter(model: nn.Module, cfg: FinetuneConfig) -> list[str]:
    from lmforge.finetune.peft_io import load_peft_adapter, read_adapter_config

    settings = read_adapter_config(cfg.init_adapter)
    if bool(settings.get("dora")) != (cfg.method == "dora"):
        kind = "DoRA" if settings.get("dora") else "LoRA"
        raise ConfigError(
            f"finetune.init_adapter={cfg.init_adapter} holds {kind} adapters but finetune.method="
            f"{cfg.method}; set finetune.method={'dora' if settings.get('dora') else 'lora'}"
        )
    wrapped = load_peft_adapter(model, cfg.init_adapter)
    for layer in lora_layers(model).values():  # dropout is a training choice: the config's, not the file's
        layer.dropout_p = cfg.dropout
        layer.lora_dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
    return wrapped


def load_finetuned(
    cfg: Config, path: str | Path, weights: str = "model", device: torch.device | str = "cpu"
) -> tuple[nn.Module, int]:
    """A fine-tuned run's model (adapters and all) with the weights at `path`, in eval mode; and its step."""
    from lmforge.checkpoint.runs import is_hf_dir, load_model, load_weights
    from lmforge.models import build_model

    if cfg.finetune.method == "full" or is_hf_dir(Path(path)):
        return load_model(cfg, path, weights, device)
    model = build_model(cfg.model, device=device)
    apply_finetune(model, cfg.finetune)
    step = load_weights(path, model, weights)
    return model.eval(), step


def merged(model: nn.Module) -> nn.Module:
    """`model` with its adapters folded into plain Linear layers (a QLoRA base is dequantised)."""
    from lmforge.finetune.nf4 import NF4Linear

    merge_lora(model)
    fold_token_rows(model)
    for name, m in list(model.named_modules()):
        if isinstance(m, NF4Linear):  # a quantised layer that had no adapter: back to a plain Linear
            parent, _, leaf = name.rpartition(".")
            linear = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            with torch.no_grad():
                linear.weight.copy_(m.dequantized_weight())
                if m.bias is not None:
                    linear.bias.copy_(m.bias)
            setattr(model.get_submodule(parent) if parent else model, leaf, linear)
    return model


def load_merged(
    cfg: Config, path: str | Path, weights: str = "model", device: torch.device | str = "cpu"
) -> tuple[nn.Module, int]:
    """`load_model` for exporters: a fine-tuned run's model with its adapters merged (a plain
    Transformer, as the checkpoint layer's HF export takes), and its step."""
    model, step = load_finetuned(cfg, path, weights, device)
    if cfg.model.quant is not None:  # `lmforge quantize`'s layers, back to plain Linear (their values exact)
        from lmforge.models.quant import dequantize_model

        dequantize_model(model)
    return (merged(model) if cfg.finetune.method != "full" else model), step


def check_adapter_run(cfg: Config, src: str | Path) -> None:
    if cfg.finetune.method == "full":
        raise LmforgeError(
            f"{src} was fully fine-tuned (finetune.method=full): it has no adapters to export; "
            "export the whole model (lmforge export without --adapter)"
        )
