"""nanoGPT as a benchmark baseline: found in a checkout the user provides, never copied into this repo.

nanoGPT is not a package: the benches take a path to a clone of https://github.com/karpathy/nanoGPT
(`--nanogpt PATH` or the environment variable LMFORGE_NANOGPT) and load its `model.py` by path. That is
the user's own code, run as they asked. What lives here: finding and loading the checkout, lmforge's
GPT-2 layout config for a nanoGPT shape, the weight copy lmforge -> nanoGPT, the initial-loss check,
and one step of nanoGPT's own train loop (train.py, gradient_accumulation_steps = 1).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from lmforge.config.schema import ModelConfig
from lmforge.engine.loss import token_loss_sum

ENV = "LMFORGE_NANOGPT"
HOW_TO_GET = (
    "nanoGPT is not a package: clone it (`git clone https://github.com/karpathy/nanoGPT`) and pass "
    f"--nanogpt PATH/TO/nanoGPT or set {ENV}=PATH/TO/nanoGPT"
)

_LOADED: dict[Path, ModuleType] = {}


def find_nanogpt(path: str | os.PathLike | None = None) -> tuple[Path | None, str]:
    """(the checkout, "") when `path` (else $LMFORGE_NANOGPT) is a directory with nanoGPT's model.py,
    else (None, why not and how to get one)."""
    given = path if path is not None else os.environ.get(ENV)
    if not given:
        return None, f"no nanoGPT checkout given. {HOW_TO_GET}"
    root = Path(given).expanduser().resolve()
    if not (root / "model.py").is_file():
        return None, f"{root} has no model.py (is it a nanoGPT checkout?). {HOW_TO_GET}"
    return root, ""


def load_nanogpt(root: Path) -> ModuleType:
    """nanoGPT's model.py of checkout `root` as a module (loaded once per path)."""
    root = root.resolve()
    if root not in _LOADED:
        name = f"nanogpt_model_{len(_LOADED)}"
        spec = importlib.util.spec_from_file_location(name, root / "model.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve their module through sys.modules
        spec.loader.exec_module(module)
        for attr in ("GPT", "GPTConfig"):
            if not hasattr(module, attr):
                raise ValueError(f"{root / 'model.py'} defines no {attr}: not nanoGPT's model.py. "
                                 f"{HOW_TO_GET}")
        _LOADED[root] = module
    return _LOADED[root]


def gpt2_config(n_layers: int, n_heads: int, d_model: int, seq_len: int, vocab: int) -> ModelConfig:
    """lmforge's GPT-2 layout, the function nanoGPT's GPT computes with bias=True and dropout 0:
    LayerNorm (eps 1e-5, with bias), learned positions, exact-erf GELU MLP of 4 * d_model, biases
    everywhere, output tied to the token table."""
    return ModelConfig(
        vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads,
        max_seq_len=seq_len, norm="layernorm", norm_eps=1e-5, pos_embedding="learned", mlp="gelu",
        bias=True, tie_embeddings=True, dropout=0.0,
    )


def build_nanogpt(module: ModuleType, cfg: ModelConfig, device: torch.device) -> torch.nn.Module:
    """nanoGPT's GPT of the same shape as `cfg`, in training mode on `device` (its init prints the
    parameter count; kept quiet)."""
    ncfg = module.GPTConfig(block_size=cfg.max_seq_len, vocab_size=cfg.vocab_size, n_layer=cfg.n_layers,
                            n_head=cfg.n_heads, n_embd=cfg.d_model, dropout=0.0, bias=True)
    with contextlib.redirect_stdout(io.StringIO()):
        model = module.GPT(ncfg)
    return model.to(device).train()


def nanogpt_optimizer(model: torch.nn.Module, device: torch.device, lr: float = 3e-4,
                      weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95)):
    """nanoGPT's own `configure_optimizers`: decay on 2-D tensors, fused AdamW on CUDA, torch's default
    (foreach) AdamW elsewhere. Same lr / betas / decay as lmforge's side."""
    with contextlib.redirect_stdout(io.StringIO()):
        return model.configure_optimizers(weight_decay, lr, betas, device.type)


def lmforge_to_nanogpt_state(sd: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """lmforge GPT-2 layout names -> nanoGPT's. Both store Linear weights (out, in); nanoGPT's c_attn
    is one Linear whose output is cat(q, k, v); lm_head is the token table (tied)."""
    out = {
        "transformer.wte.weight": sd["tok_embeddings.weight"],
        "lm_head.weight": sd["tok_embeddings.weight"],
        "transformer.wpe.weight": sd["pos_embeddings.weight"],
        "transformer.ln_f.weight": sd["norm.weight"],
        "transformer.ln_f.bias": sd["norm.bias"],
    }
    names = {"attn_norm": "ln_1", "attn.wo": "attn.c_proj", "mlp_norm": "ln_2", "mlp.w_up": "mlp.c_fc",
             "mlp.w_down": "mlp.c_proj"}
    for i in range(n_layers):
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        for kind in ("weight", "bias"):
            for a, b in names.items():
                out[f"{theirs}{b}.{kind}"] = sd[f"{ours}{a}.{kind}"]
            out[f"{theirs}attn.c_attn.{kind}"] = torch.cat(
                [sd[f"{ours}attn.{w}.{kind}"] for w in ("wq", "wk", "wv")], dim=0
            )
    return out


def check_same_function(ours: torch.nn.Module, nano: torch.nn.Module, cfg: ModelConfig,
                        x: torch.Tensor, y: torch.Tensor) -> dict:
    """Copy lmforge's weights into nanoGPT's GPT; the initial fp32 losses must agree to 1e-4.

    Run in fp32 without TF32 (the caller's autocast is not active here) so that the comparison
    checks the function, not the rounding of a faster matmul mode."""
    missing, unexpected = nano.load_state_dict(lmforge_to_nanogpt_state(ours.state_dict(), cfg.n_layers),
                                               strict=False)
    # nanoGPT registers a causal-mask buffer named attn.bias only where its torch lacks SDPA.
    missing = [k for k in missing if not k.endswith(".attn.bias")]
    assert not missing and not unexpected, (missing, unexpected)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            logits = ours(x)
            loss_ours = float(token_loss_sum(logits, y) / y.numel())
            _, loss_nano = nano(x, y)
            loss_nano = float(loss_nano)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    res = dict(loss_lmforge=loss_ours, loss_nanogpt=loss_nano, abs_diff=abs(loss_ours - loss_nano))
    assert res["abs_diff"] < 1e-4, res
    return res


def nanogpt_stepper(model: torch.nn.Module, optimizer: torch.optim.Optimizer, autocast,
                    batches: list[tuple[torch.Tensor, torch.Tensor]], grad_clip: float = 1.0
                    ) -> Callable[[int], torch.Tensor]:
    """One iteration of nanoGPT's train.py with gradient_accumulation_steps = 1: the forward with
    targets under its autocast context, backward, clip_grad_norm_, step, zero_grad(set_to_none=True).
    (Its GradScaler is disabled outside fp16 and its `loss / 1` is left out.) `model` is whatever
    train.py would call: the GPT, or torch.compile(GPT) with compile=True. Returns the loss tensor
    without synchronising, as train.py reads it only at log steps."""

    def step(i: int) -> torch.Tensor:
        x, y = batches[i % len(batches)]
        with autocast():
            _, loss = model(x, y)
        loss.backward()
        if grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step
