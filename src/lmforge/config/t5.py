"""The checks of `model.arch: t5` (the encoder-decoder of models/t5.py) against the rest of the model section.

T5's blocks are fixed: RMS norms without bias, no biases anywhere, full multi-head attention with a
bucketed relative position bias, a ReLU or gated-GELU feed-forward. Every other block flag of the model
section belongs to the decoder or the BERT encoder; a T5 config that sets one would silently not get it,
so it is refused by name. The T5-only fields are refused on the other architectures for the same reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmforge.config.model import ModelConfig

# Fields T5's blocks have no place for: they must keep their defaults on a T5 model.
_NOT_T5 = ("bias", "qkv_bias", "qk_norm", "qk_norm_scope", "attn_out_bias", "moe", "mla", "sliding_window",
           "rope_scaling", "score_head", "value_head", "quant", "attn_sinks",
           "norm_weight_offset", "embed_scale", "attn_logit_softcap", "final_logit_softcap",
           "query_pre_attn_scalar", "layer_types", "rope_local_theta", "rotary_fraction", "nope_layers",
           "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
           "position_offset", "init", "init_std")
# T5-only fields: on another architecture they must keep their defaults.
_T5_ONLY = ("n_decoder_layers", "relative_attention_num_buckets", "relative_attention_max_distance",
            "scale_decoder_output", "decoder_start_token_id")


def _default(cfg: ModelConfig, name: str):
    field = type(cfg).model_fields[name]
    return field.default_factory() if field.default_factory is not None else field.default


def check_t5_fields(cfg: ModelConfig) -> None:
    """ValueError naming the fields that do not fit `cfg.arch` (t5 or not)."""
    if cfg.arch != "t5":
        set_keys = [f"{k}={getattr(cfg, k)!r}" for k in _T5_ONLY if getattr(cfg, k) != _default(cfg, k)]
        set_keys += [f"{k}={v}" for k, v in (("pos_embedding", cfg.pos_embedding), ("mlp", cfg.mlp))
                     if v in ("relative", "relu")]
        if set_keys:
            raise ValueError(f"model.arch={cfg.arch} does not take {', '.join(set_keys)}: they belong to the "
                             "encoder-decoder (model.arch=t5); unset them or set arch=t5")
        return
    clashes = [f"{k}=" + ("(set)" if hasattr(getattr(cfg, k), "model_fields") else repr(getattr(cfg, k)))
               for k in _NOT_T5 if getattr(cfg, k) != _default(cfg, k)]  # a section as "(set)", not its repr
    if cfg.norm_placement != "pre":  # T5's blocks are Pre-LN (what an unset norm_placement resolves to)
        clashes.append(f"norm_placement={cfg.norm_placement!r}")
    if cfg.pos_embedding != "relative":
        clashes.append(f"pos_embedding={cfg.pos_embedding} (T5 has relative position buckets: relative)")
    if cfg.mlp not in ("relu", "geglu"):
        clashes.append(f"mlp={cfg.mlp} (T5 1.0: relu; v1.1 / Flan gated-gelu: geglu)")
    if cfg.norm != "rmsnorm":
        clashes.append(f"norm={cfg.norm} (T5's layer norm is an RMS norm: rmsnorm)")
    if cfg.resolved_kv_heads != cfg.n_heads:
        clashes.append(f"n_kv_heads={cfg.n_kv_heads} (T5 has no grouped-query attention: n_heads)")
    if cfg.hf_model_type not in (None, "t5"):
        clashes.append(f"hf_model_type={cfg.hf_model_type} (t5)")
    if clashes:
        raise ValueError("model.arch=t5 builds T5's encoder-decoder blocks, which do not take: "
                         + "; ".join(clashes) + ". Unset them (init: T5 initialises by its own rule)")



def refuse_t5(cfg, what: str) -> None:
    """ConfigError before any work when `what` (a verb) meets an encoder-decoder, which this version
    imports, exports, pretrains and generates with only."""
    from lmforge.errors import ConfigError

    if cfg.model.arch == "t5":
        raise ConfigError(f"{what} is not available for an encoder-decoder (model.arch=t5) yet: T5 models "
                          "can be imported (`lmforge import`), exported (`lmforge export`), pretrained with "
                          "objective span_corruption (`lmforge train`), fine-tuned on input -> target "
                          "records (`lmforge sft`: objective seq2seq), evaluated (`lmforge eval loss`, "
                          "`lmforge eval exact --tasks FILE.jsonl`) and generate from an input text "
                          "(`lmforge generate --prompt ...`)")


def check_t5_training(cfg, world_size: int) -> None:
    """ConfigError for what T5 training cannot do yet: tensor, pipeline and expert parallelism (their
    plans know the decoder's blocks only). Data parallelism is DDP or FSDP (each encoder and decoder block
    its own unit: parallel/data_parallel.py); LoRA, DoRA and QLoRA take T5's layers by name
    (finetune/t5_lora.py)."""
    from lmforge.errors import ConfigError

    if cfg.model.arch != "t5":
        return
    p = cfg.parallel
    degrees = (("pp", p.pp), ("tp", p.tp), ("ep", p.ep))
    bad = [f"parallel.{k}={v}" for k, v in degrees if v > 1]
    if cfg.train.activation_checkpointing != "none":  # it wraps the decoder's blocks (model.layers)
        bad.append(f"train.activation_checkpointing={cfg.train.activation_checkpointing}")
    if cfg.train.compile and world_size > 1:  # several processes compile the decoder's blocks one by one
        bad.append("train.compile=true with several processes")
    if bad:
        raise ConfigError(f"an encoder-decoder (model.arch=t5) trains in one process or data-parallel (DDP, "
                          f"FSDP) only so far: {', '.join(bad)} is not available; set parallel.tp/pp/ep to "
                          "1, train.activation_checkpointing=none, train.compile=false")
