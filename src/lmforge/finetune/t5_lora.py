"""LoRA target names for the encoder-decoder (model.arch=t5, models/t5.py).

Our T5 names its linear layers as the decoder does: `{encoder,decoder}.layers.{i}.attn.{wq,wk,wv,wo}`
(self-attention), `decoder.layers.{i}.cross.{wq,wk,wv,wo}` (cross-attention to the encoder output),
`{encoder,decoder}.layers.{i}.mlp.{w_up,w_gate,w_down}` and `output` (an untied head). Besides these names
(and globs and dotted suffixes of them), a T5 takes transformers' T5 module names as PEFT uses them:

    q, k, v, o           both attentions (SelfAttention and EncDecAttention), as PEFT's suffix match does
    SelfAttention.q ...  self-attention only;  EncDecAttention.q ...  cross-attention only
    wi (T5 1.0), wi_0 / wi_1 (gated v1.1 / Flan)   the feed-forward's input(s): w_up, w_gate / w_up
    DenseReluDense.wo    the feed-forward's output (w_down);  lm_head   the untied head

A bare `wo` is refused on a T5: it is our attention output's name and transformers' feed-forward output's,
and the two readings would train different layers. The Llama names (q_proj, ...) name no T5 module.
"""

from __future__ import annotations

from torch import nn

from lmforge.errors import ConfigError

_ATTN = {"q": "wq", "k": "wk", "v": "wv", "o": "wo"}
# T5 module name -> our dotted suffix(es); PEFT matches target names as suffixes of module names, as we do.
TARGETS: dict[str, str | tuple[str, ...]] = {
    **{h: (f"attn.{w}", f"cross.{w}") for h, w in _ATTN.items()},
    **{f"SelfAttention.{h}": f"attn.{w}" for h, w in _ATTN.items()},
    **{f"EncDecAttention.{h}": f"cross.{w}" for h, w in _ATTN.items()},
    "wi": "mlp.w_up",
    "wi_0": "mlp.w_gate",
    "wi_1": "mlp.w_up",
    "DenseReluDense.wi": "mlp.w_up",
    "DenseReluDense.wi_0": "mlp.w_gate",
    "DenseReluDense.wi_1": "mlp.w_up",
    "DenseReluDense.wo": "mlp.w_down",
    "lm_head": "output",
}
# What PEFT's all-linear takes on T5ForConditionalGeneration: every block linear of both stacks, no head.
BLOCKS = ("encoder.layers.", "decoder.layers.")


def is_t5(model: nn.Module) -> bool:
    return getattr(getattr(model, "cfg", None), "arch", None) == "t5"


def check_targets(targets: str | list[str] | tuple[str, ...]) -> None:
    """ConfigError for a target whose meaning differs between our names and T5's (bare `wo`)."""
    for pattern in [targets] if isinstance(targets, str) else targets:
        if pattern == "wo":
            raise ConfigError(
                "LoRA target 'wo' is ambiguous on a T5: lmforge's attention output (attn.wo, cross.wo) or "
                "transformers' feed-forward output (DenseReluDense.wo = mlp.w_down). Name 'o' (both "
                "attention outputs), 'attn.wo' / 'cross.wo', or 'DenseReluDense.wo' / 'w_down'"
            )


def block_linear(name: str, module: nn.Module) -> bool:
    """QLoRA's selection on a T5: every nn.Linear in the blocks of either stack (not the head)."""
    return isinstance(module, nn.Linear) and name.startswith(BLOCKS)
