"""model.attention_dropout / model.hidden_dropout against the config.json a family writes.

A family writes the split dropouts where its Hugging Face config has a field for them (BERT / RoBERTa:
attention_probs_dropout_prob and hidden_dropout_prob; GPT-2: attn_pdrop, resid_pdrop and embd_pdrop;
the Llama-like families: attention_dropout only). An export whose config.json would not carry a value
the user set is refused rather than written without it. model.dropout alone keeps its older rule (a
training setting that exports only where the family has all its fields), so existing exports are
unchanged.
"""

from __future__ import annotations

from typing import Any

from lmforge.config.model import ModelConfig
from lmforge.errors import LmforgeError

# The config.json keys that carry each kind of dropout, by family layout.
_ATTENTION_KEYS = ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout")
_HIDDEN_KEYS = (("hidden_dropout_prob",), ("resid_pdrop", "embd_pdrop"))


def _lost(value: float | None, hf: dict[str, Any], keys: tuple[str, ...], what: str) -> str | None:
    """Why `value` (a set dropout) is not what `hf` carries in `keys`; None when it is (or is unset)."""
    if value is None:
        return None
    if not keys:  # no field: only "no dropout" survives the trip
        return None if value == 0 else f"no {what} dropout field"
    written = {k: hf[k] for k in keys}
    return None if all(float(v) == value for v in written.values()) else f"written: {written}"


def check_dropouts(cfg: ModelConfig, hf: dict[str, Any], model_type: str) -> None:
    """LmforgeError when `hf` (config.json for `model_type`) loses a set attention or hidden dropout."""
    attention = tuple(k for k in _ATTENTION_KEYS if k in hf)
    hidden = next((keys for keys in _HIDDEN_KEYS if all(k in hf for k in keys)), ())
    problems = [
        f"model.{key}={value} ({why})"
        for key, value, why in (
            ("attention_dropout", cfg.attention_dropout,
             _lost(cfg.attention_dropout, hf, attention, "attention")),
            ("hidden_dropout", cfg.hidden_dropout,
             _lost(cfg.hidden_dropout, hf, hidden, "residual/embedding")),
        )
        if why is not None
    ]
    if problems:
        raise LmforgeError(f"this model cannot be exported as Hugging Face {model_type!r} without losing its "
                           f"dropout: {'; '.join(problems)}; dropout acts only in training, so the weights "
                           "are the same without it: set it to 0 (or null: model.dropout) in the model "
                           "section of the source's config.yaml, or export as a family that has the field")
