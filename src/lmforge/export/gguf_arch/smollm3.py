"""SmolLM3 as llama.cpp's `smollm3`: Llama's layout and pair-wise RoPE (q/k rows permuted as for
`llama`) where some layers apply no RoPE. llama.cpp has no key for which ones: its smollm3 skips RoPE on
every 4th layer (layer i when (i + 1) % 4 == 0, SmolLM3-3B's no_rope_layer_interval), so a model whose
NoPE layers are any others is refused. Its smollm3 loads no output-projection or MLP biases, nor RoPE
frequency factors (Llama 3.1 scaling): refused too (the latter by `rope_keys`)."""

from __future__ import annotations

from typing import Any

from lmforge.errors import LmforgeError
from lmforge.export.gguf_arch.common import Context, llama_metadata, mapped
from lmforge.export.gguf_arch.granite import rope_pairs

ARCHES = {"smollm3": "smollm3"}
LLAMA_CPP_NOPE_STEP = 4  # llama.cpp's hparams.n_no_rope_layer_step for smollm3, fixed


def nope_layers(cfg: dict[str, Any]) -> list[int]:
    """The layers that skip RoPE, as lmforge's importer reads the config."""
    from lmforge.models.hf import smollm3

    return smollm3.config_from_hf(cfg)["nope_layers"]


def check(cfg: dict[str, Any]) -> None:
    n = int(cfg["num_hidden_layers"])
    theirs = [i for i in range(n) if (i + 1) % LLAMA_CPP_NOPE_STEP == 0]
    ours = nope_layers(cfg)
    if ours != theirs:
        raise LmforgeError(f"GGUF export cannot write this SmolLM3: its layers without RoPE are {ours}, and "
                           f"llama.cpp's smollm3 skips RoPE on every {LLAMA_CPP_NOPE_STEP}th layer only "
                           f"({theirs} of {n}: no_rope_layer_interval={LLAMA_CPP_NOPE_STEP}); "
                           "use --format hf")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise LmforgeError("GGUF export cannot write a SmolLM3 with attention_bias / mlp_bias: llama.cpp's "
                           "smollm3 has no output-projection or MLP biases; use --format hf")


def metadata(ctx: Context) -> None:
    llama_metadata(ctx)  # context_length caps a sliding window (llama.cpp's smollm3 has none)


def plan(ctx: Context):
    return mapped(ctx, lambda name, t: rope_pairs(ctx, name, t))
