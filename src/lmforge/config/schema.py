"""The one typed config tree. Every field has a default and a one-line doc (its `description`).

YAML is its serialised form (`lmforge.config.load`), `--set a.b=c` the only second level. Unknown keys,
wrong types and out-of-range values are errors raised before any work starts.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from lmforge.config.curate import CurateConfig
from lmforge.config.methods import CausalLMObjective, ObjectiveConfig, check_arch
from lmforge.config.optim import AdamWConfig, OptimConfig
from lmforge.config.presets import PRESETS
from lmforge.config.section import SEED_MAX, Section


class RunConfig(Section):
    name: str = Field("run", description="Human-readable run name (used in logs and reports).")
    dir: str = Field("runs/run", description="Run directory: config, metrics, plots and checkpoints go here.")
    seed: int = Field(1337, ge=0, le=SEED_MAX, description="Seed for model init, dropout and data order.")
    overwrite: bool = Field(
        False, description="Allow training into a run dir that already holds another run (deletes it)."
    )


class TokenizerConfig(Section):
    path: str | None = Field(
        None, description="Existing tokenizer.json to use; when unset a byte-level BPE is trained."
    )
    vocab_size: int = Field(8192, ge=260, le=1_000_000, description="Vocabulary size of a trained BPE.")
    min_frequency: int = Field(2, ge=1, description="Minimum pair frequency for a BPE merge.")
    train_chars: int = Field(
        50_000_000, ge=1000, description="At most this many characters of the corpus train the tokenizer."
    )


class DataConfig(Section):
    sources: list[str] = Field(
        default_factory=lambda: ["builtin:python"],
        description="Text sources: files or folders of .txt/.md/.jsonl, or 'builtin:python' "
        "(the docs and stdlib source of the running Python).",
    )
    dir: str | None = Field(
        None, description="Where prepared shards and the tokenizer go (default: <run.dir>/data)."
    )
    text_key: str = Field("text", description="Field holding the document text in JSONL records.")
    val_fraction: float = Field(
        0.02, gt=0.0, lt=0.5, description="Fraction of documents held out for validation."
    )
    val_sources: list[str] = Field(
        default_factory=list, description="Validation text of your choosing (files or folders, read like "
        "data.sources): with it every document of data.sources trains and val_fraction is not used."
    )
    max_chars: int | None = Field(
        None, ge=1, description="Stop reading sources after this many characters (None: read all)."
    )
    on_bad_utf8: Literal["skip", "fail"] = Field(
        "skip", description="A file that is not UTF-8: skip it and count it, or fail with its path."
    )
    on_bad_json: Literal["skip", "fail"] = Field(
        "fail", description="A malformed JSONL line: skip it and count it, or fail with file and line."
    )
    shard_tokens: int = Field(
        1 << 24, ge=1024, description="Tokens per shard file (shards are memory-mapped when loading)."
    )
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="Tokenizer settings.")


class RopeScalingConfig(Section):
    """RoPE context extension, as in Hugging Face `rope_scaling` / `rope_parameters` (linear, dynamic NTK,
    llama3, yarn, longrope)."""

    type: Literal["linear", "dynamic", "llama3", "yarn", "longrope"] = Field(
        "linear", description="linear: positions / factor; dynamic: NTK base growth past the original "
        "length; llama3: per-frequency interpolation (Llama 3.1); yarn: NTK-by-parts interpolation with an "
        "attention factor (Qwen, DeepSeek-V3, gpt-oss); longrope: per-frequency factors, short up to the "
        "original length and long past it (Phi-3)."
    )
    factor: float = Field(1.0, ge=1.0, description="Context extension factor.")
    original_max_position_embeddings: int | None = Field(
        None, ge=1, description="Context length the model was trained with (dynamic, llama3, yarn, longrope)."
    )
    low_freq_factor: float = Field(1.0, gt=0.0, description="llama3: low-frequency wavelength factor.")
    high_freq_factor: float = Field(4.0, gt=0.0, description="llama3: high-frequency wavelength factor.")
    beta_fast: float = Field(32.0, gt=0.0, description="yarn: rotations past which a frequency is kept "
                             "as is.")
    beta_slow: float = Field(1.0, gt=0.0, description="yarn: rotations below which a frequency is divided "
                             "by factor.")
    mscale: float | None = Field(None, description="yarn: numerator scale of the attention factor "
                                 "0.1*mscale*ln(factor)+1 (used with mscale_all_dim; DeepSeek-V3).")
    mscale_all_dim: float | None = Field(None, description="yarn: denominator scale of the attention factor "
                                         "(used with mscale).")
    attention_factor: float | None = Field(
        None, gt=0.0, description="yarn and longrope: the scale of cos and sin (None: derived from factor "
        "as transformers does)."
    )
    truncate: bool = Field(True, description="yarn: round the correction range to whole dimensions "
                           "(gpt-oss: false).")
    short_factor: list[float] | None = Field(
        None, description="longrope: one divisor per rotary frequency (rotary_dim/2 values) for sequences up "
        "to original_max_position_embeddings."
    )
    long_factor: list[float] | None = Field(
        None, description="longrope: one divisor per rotary frequency for sequences longer than "
        "original_max_position_embeddings."
    )


class QuantConfig(Section):
    """Weight-only quantization of a model's linear layers (written by `lmforge quantize`; inference only)."""

    bits: Literal[4, 8] = Field(4, description="Bits per weight: 4 (two per byte) or 8.")
    group_size: int | None = Field(
        128, ge=2, description="Weights per scale along the input dimension (None: one scale per output "
        "channel); must divide every quantized layer's in_features."
    )
    symmetric: bool = Field(True, description="Symmetric (scale only) or asymmetric (scale + zero point).")
    method: Literal["rtn", "gptq"] = Field(
        "rtn", description="How the integers were chosen: round-to-nearest or GPTQ (a record; loading is "
        "the same)."
    )
    targets: list[str] = Field(
        default_factory=lambda: ["layers.*"], description="Linear layers to quantize, as globs over module "
        "names (layers.*: every linear layer of the blocks; layers.*.mlp.*: the MLPs only)."
    )
    head: bool = Field(False, description="Quantize the output head too (untied embeddings only).")
    embeddings: bool = Field(
        False, description="Quantize the token embedding table too (round to nearest; with tied embeddings "
        "the output head reads the same quantized table)."
    )
    scale_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="dtype the scales are stored in."
    )


class MoEConfig(Section):
    """Mixture of experts in place of every block's MLP (models/moe.py): a router picks top_k of n_experts
    SwiGLU experts per token, optionally beside always-on shared experts."""

    n_experts: int = Field(8, ge=1, description="Routed experts per MoE layer.")
    top_k: int = Field(2, ge=1, description="Experts each token is sent to (must be <= n_experts).")
    d_ff_expert: int | None = Field(
        None, ge=1, description="Hidden size of each routed expert (None: model d_ff).")
    n_shared_experts: int = Field(
        0, ge=0, description="Always-on shared experts (DeepSeek / Qwen2-MoE); they form one SwiGLU MLP "
        "of n_shared_experts * shared_d_ff hidden units.")
    shared_d_ff: int | None = Field(
        None, ge=1, description="Hidden size of one shared expert (None: d_ff_expert).")
    shared_gate: bool = Field(
        False, description="Scale the shared experts' output by sigmoid(a learned d_model -> 1 gate) "
        "(Qwen2-MoE's shared_expert_gate).")
    router_score: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="Router scores from the logits: softmax over experts (Mixtral, Qwen2-MoE, "
        "OLMoE) or an independent sigmoid per expert (DeepSeek-V3).")
    norm_topk_prob: bool = Field(
        True, description="Renormalise the top_k scores of a token to sum to 1 (Mixtral: yes; Qwen2-MoE "
        "and OLMoE: their norm_topk_prob).")
    aux_loss_coef: float = Field(
        0.01, ge=0.0, description="Weight of the Switch load-balancing loss E * sum_i f_i * P_i (f_i: "
        "assignments per token that went to expert i, P_i: its mean router probability; top_k when "
        "balanced): the normalisation of transformers' load_balancing_loss_func (router_aux_loss_coef).")
    aux_loss_scope: Literal["layer", "model"] = Field(
        "layer", description="layer: each MoE layer's balance loss on its own, averaged over layers (Switch, "
        "GShard, Megatron); model: f and P pooled over all layers before the product, exactly as "
        "transformers' load_balancing_loss_func aggregates (what an imported model trained with).")
    z_loss_coef: float = Field(
        0.0, ge=0.0, description="Weight of the ST-MoE router z-loss mean(logsumexp(logits)^2), averaged "
        "over MoE layers (ST-MoE uses 1e-3).")
    capacity_factor: float | None = Field(
        None, gt=0.0, description="None: dropless. Else each expert takes at most ceil(capacity_factor * "
        "tokens * top_k / n_experts) assignments per forward; the overflow (later tokens first, by position "
        "in the batch) gets no expert output and keeps the residual.")
    bias_balancing: bool = Field(
        False, description="Aux-loss-free balancing (DeepSeek-V3): a per-expert bias, added to the scores "
        "for the top-k choice only, moves by bias_update_rate * sign(mean load - load) after every "
        "optimizer step.")
    bias_update_rate: float = Field(
        1e-3, gt=0.0, description="Step of the balancing bias per optimizer step (DeepSeek-V3's gamma).")
    # [issue-34 area: deepseek-mla] routing and layout of DeepSeek-V3's MoE
    n_group: int = Field(
        1, ge=1, description="Expert groups for group-limited routing (DeepSeek-V3): a token picks its "
        "top_k experts among the topk_group groups whose two best scores sum highest (1: no groups).")
    topk_group: int = Field(1, ge=1, description="Groups a token may route to (with n_group > 1).")
    routed_scaling: float = Field(
        1.0, gt=0.0, description="Factor on the routed experts' weights after any renormalisation "
        "(DeepSeek-V3's routed_scaling_factor, 2.5).")
    dense_layers: int = Field(
        0, ge=0, description="The first dense_layers blocks keep a dense SwiGLU MLP of model.d_ff instead of "
        "the mixture (DeepSeek-V3's first_k_dense_replace).")
    # [issue-34 area: gpt-oss] router and expert biases, the clamped SwiGLU
    router_bias: bool = Field(False, description="The router's gate has a learned bias, added to its logits "
                              "(gpt-oss's router.bias).")
    experts_bias: bool = Field(False, description="Every expert's gate, up and down projections have biases "
                               "(gpt-oss's gate_up_proj_bias / down_proj_bias).")
    expert_act: Literal["swiglu", "clamped_swiglu"] = Field(
        "swiglu", description="swiglu: silu(gate) * up; clamped_swiglu (gpt-oss): gate clamped to at most "
        "swiglu_limit, up to [-swiglu_limit, swiglu_limit], then (up + 1) * gate * sigmoid(swiglu_alpha * "
        "gate).")
    swiglu_alpha: float | None = Field(
        None, gt=0.0, description="clamped_swiglu: the sigmoid's gain (gpt-oss 1.702); set only with it.")
    swiglu_limit: float | None = Field(
        None, gt=0.0, description="clamped_swiglu: the clamp bound (gpt-oss 7.0); set only with it.")

    @model_validator(mode="after")
    def _check(self) -> MoEConfig:
        if self.top_k > self.n_experts:
            raise ValueError(f"moe.top_k={self.top_k} exceeds moe.n_experts={self.n_experts}: a token cannot "
                             "go to more experts than there are; lower top_k or raise n_experts")
        if self.shared_gate and self.n_shared_experts == 0:
            raise ValueError("moe.shared_gate=true gates the shared experts, but moe.n_shared_experts=0; set "
                             "n_shared_experts >= 1 or shared_gate=false")
        if self.shared_d_ff is not None and self.n_shared_experts == 0:
            raise ValueError("moe.shared_d_ff is set but moe.n_shared_experts=0; set n_shared_experts >= 1 "
                             "or leave shared_d_ff unset")
        if self.n_group > 1 or self.topk_group > 1:
            per = self.n_experts // self.n_group
            if self.n_experts % self.n_group or per < 2:
                raise ValueError(f"moe.n_group={self.n_group} must divide moe.n_experts={self.n_experts} "
                                 "into groups of at least 2 experts (a group's score: its two best experts)")
            if self.topk_group > self.n_group or self.top_k > self.topk_group * per:
                raise ValueError(f"moe.topk_group={self.topk_group} must be <= n_group={self.n_group} and "
                                 f"leave at least top_k={self.top_k} experts ({per} per group)")
        clamped = self.expert_act == "clamped_swiglu"
        if clamped != (self.swiglu_alpha is not None) or clamped != (self.swiglu_limit is not None):
            raise ValueError(
                f"moe.expert_act={self.expert_act} with swiglu_alpha={self.swiglu_alpha}, swiglu_limit="
                f"{self.swiglu_limit}: clamped_swiglu needs both set (gpt-oss: 1.702 and 7.0); swiglu uses "
                "neither, so leave them unset")
        return self


class MLAConfig(Section):
    """Multi-head latent attention (DeepSeek-V2/V3, models/common/mla.py): keys and values are expanded
    per head from one compressed latent per token, which is what the KV cache holds, plus a small key
    part with decoupled RoPE shared by all heads."""

    q_lora_rank: int | None = Field(
        None, ge=1, description="Rank of the low-rank query projection d_model -> q_lora_rank (RMSNorm) -> "
        "heads (None: one plain query projection).")
    kv_lora_rank: int = Field(512, ge=1, description="Size of the compressed key/value latent per token.")
    qk_nope_head_dim: int = Field(128, ge=1, description="Per-head query/key size without RoPE.")
    qk_rope_head_dim: int = Field(64, ge=2, description="Per-head query/key size with RoPE (the key part "
                                  "is shared by all heads); even.")
    v_head_dim: int = Field(128, ge=1, description="Per-head value size.")
    rope_interleave: bool = Field(
        False, description="RoPE over interleaved pairs (x0, x1), (x2, x3), ... of the rotary part "
        "(DeepSeek's checkpoints, HF rope_interleave) instead of the two halves.")
    attention_bias: bool = Field(
        False, description="Biases on the q_a, kv_a and output projections (HF attention_bias).")
    latent_norm_eps: float = Field(
        1e-6, gt=0.0, description="Epsilon of the RMSNorms over the q and kv latents.")

    @model_validator(mode="after")
    def _check(self) -> MLAConfig:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"mla.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates "
                             "pairs)")
        return self


class ModelConfig(Section):
    preset: str | None = Field(
        None, description=f"Named size filling the other keys; explicit keys win. One of {sorted(PRESETS)}."
    )
    vocab_size: int | None = Field(
        None, ge=2, description="Vocabulary size (None: the tokenizer's, rounded up to a multiple of 64)."
    )
    d_model: int = Field(256, ge=1, description="Hidden size.")
    n_layers: int = Field(4, ge=1, description="Number of transformer blocks.")
    n_heads: int = Field(4, ge=1, description="Attention (query) heads.")
    n_kv_heads: int | None = Field(
        None, ge=1, description="Key/value heads (None: = n_heads; fewer: grouped-query attention)."
    )
    head_dim: int | None = Field(None, ge=1, description="Per-head size (None: d_model // n_heads).")
    d_ff: int | None = Field(
        None, ge=1, description="MLP hidden size (None: 4*d_model for gelu, Llama's 8/3 rule for swiglu)."
    )
    max_seq_len: int = Field(256, ge=1, description="Longest sequence the model is built for.")
    norm: Literal["rmsnorm", "layernorm"] = Field("rmsnorm", description="Normalisation layer.")
    norm_eps: float = Field(1e-5, gt=0.0, description="Epsilon of the normalisation layers.")
    pos_embedding: Literal["rope", "learned"] = Field(
        "rope", description="Rotary position embedding or a learned absolute position table."
    )
    rope_theta: float = Field(10000.0, gt=0.0, description="RoPE base frequency.")
    mlp: Literal["swiglu", "gelu", "gelu_tanh", "geglu"] = Field(
        "swiglu", description="MLP type: SwiGLU (Llama), GELU (erf), GELU tanh approximation (GPT-2), or "
        "GeGLU (Gemma: a gate through GELU's tanh approximation)."
    )
    bias: bool = Field(False, description="Biases in every linear layer and in LayerNorm (GPT-2 style).")
    qkv_bias: bool = Field(False, description="Biases in the q/k/v projections only (Qwen2 style).")
    qk_norm: bool = Field(False, description="RMSNorm over the whole q and k projections before RoPE "
                          "(OLMoE / OLMo-2 style).")
    tie_embeddings: bool = Field(True, description="Share the input embedding and output projection.")
    score_head: bool = Field(False, description="A scalar head `score` (d_model -> 1, no bias) beside the "
                             "output projection: a reward model (objective reward) reads it at a sequence's "
                             "last token; exported as ...ForSequenceClassification with num_labels 1.")
    arch: Literal["decoder", "encoder"] = Field(
        "decoder", description="decoder: causal LM (models/transformer.py); encoder: bidirectional masked LM "
        "(models/encoder.py: BERT / RoBERTa layout, post-norm blocks, an MLM head; objective mlm)."
    )
    type_vocab_size: int = Field(2, ge=0, description="encoder: rows of the token-type (segment) embedding "
                                 "(BERT 2, RoBERTa 1, 0: none).")
    position_offset: int = Field(0, ge=0, description="encoder: learned positions start at this row and "
                                 "count the tokens that are not id offset-1 (padding, which sits at row "
                                 "offset-1): RoBERTa's padding_idx + 1; BERT: 0, positions 0..T-1.")
    value_head: bool = Field(False, description="A scalar head `value` (d_model -> 1, no bias): PPO's critic "
                             "on the policy's own hidden states (objective rl, rl.algorithm=ppo); not "
                             "exported.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on attention, residual and embeddings.")
    sliding_window: int | None = Field(
        None, ge=1, description="Attend to at most this many previous tokens (Mistral style)."
    )
    rope_scaling: RopeScalingConfig | None = Field(
        None, description="RoPE scaling for context extension (None: plain RoPE)."
    )
    init_std: float = Field(0.02, gt=0.0, description="Std of the normal init of weights.")
    init: Literal["normal", "xavier", "kaiming", "small_init"] = Field(
        "normal", description="Weight init: normal(init_std) with residual projections scaled by "
        "1/sqrt(2*n_layers); xavier (Glorot uniform); kaiming (He normal, fan_in); small_init "
        "(normal with embeddings/output at 1e-4 scale and hidden std sqrt(2/(5*d_model)))."
    )
    init_from: str | None = Field(
        None, description="Start from these weights instead of a random init: a Hugging Face model dir, "
        "an `lmforge import` dir, a run dir or a checkpoint dir (the shapes must match this section)."
    )
    quant: QuantConfig | None = Field(
        None, description="Weight-only quantization of the linear layers (None: full precision); set by "
        "`lmforge quantize`, for inference only."
    )
    moe: MoEConfig | None = Field(
        None, description="Mixture of experts in place of the MLPs (None: dense); not with pipeline "
        "parallelism."
    )
    # [issue-34 area: qwen3-granite-smollm3]
    qk_norm_scope: Literal["all", "head"] = Field(
        "all", description="With qk_norm: all normalises the whole q and k projections (OLMoE / OLMo 2); "
        "head normalises each head's q and k with one shared weight of head_dim (Qwen3). Needs qk_norm=true.")
    attn_out_bias: bool = Field(False, description="A bias on the attention output projection wo (with "
                                "qkv_bias: Qwen3's attention_bias on q/k/v/o; bias=true already has it).")
    embedding_multiplier: float = Field(1.0, gt=0.0, description="Scale of the token embeddings before the "
                                        "first block (Granite's embedding_multiplier).")
    residual_multiplier: float = Field(1.0, gt=0.0, description="Scale of each attention and MLP output "
                                       "before its residual add (Granite's residual_multiplier).")
    attention_multiplier: float | None = Field(
        None, gt=0.0, description="Softmax scale of the attention scores (None: 1/sqrt(head_dim); Granite's "
        "attention_multiplier).")
    logits_scaling: float = Field(1.0, gt=0.0, description="The logits are divided by this (Granite's "
                                  "logits_scaling).")
    nope_layers: list[int] = Field(
        default_factory=list, description="Indices of the layers that apply no RoPE (NoPE; SmolLM3's "
        "no_rope_layers); the other layers rotate q and k as usual. Needs pos_embedding=rope.")
    # [issue-34 area: gemma-olmo2]
    norm_placement: Literal["pre", "post", "sandwich"] = Field(
        "pre", description="Where each block's norms sit: pre x + f(norm(x)) (Llama); post x + norm(f(x)) "
        "(OLMo 2: norms on the outputs only); sandwich x + norm(f(norm(x))) (Gemma 2 / 3)."
    )
    norm_weight_offset: float = Field(
        0.0, description="RMSNorm scales by (offset + weight), in float32: 1.0 for Gemma's (1 + w) norms, "
        "whose identity weight is 0; 0.0 the usual x * w."
    )
    embed_scale: bool = Field(False, description="Multiply the token embeddings by sqrt(d_model), rounded to "
                              "the model's dtype (Gemma).")
    attn_logit_softcap: float | None = Field(
        None, gt=0.0, description="Soft-cap attention scores as cap * tanh(s / cap) before the mask "
        "(Gemma 2; None: off). Runs an explicit attention instead of SDPA's fused kernels."
    )
    final_logit_softcap: float | None = Field(
        None, gt=0.0, description="Soft-cap the output logits as cap * tanh(z / cap) (Gemma 2; None: off)."
    )
    query_pre_attn_scalar: int | None = Field(
        None, ge=1, description="Attention scale is query_pre_attn_scalar ** -0.5 (Gemma; None: head_dim)."
    )
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = Field(
        None, description="Per-layer attention kind, one per layer: sliding_attention layers see "
        "sliding_window keys, full_attention layers all (Gemma's alternation); None: every layer slides "
        "iff sliding_window is set."
    )
    rope_local_theta: float | None = Field(
        None, gt=0.0, description="RoPE base of the sliding_attention layers, without rope_scaling (Gemma "
        "3's rope_local_base_freq); None: every layer uses rope_theta and rope_scaling."
    )
    # [issue-34 area: phi3-rope]
    rotary_fraction: float = Field(
        1.0, gt=0.0, le=1.0, description="RoPE rotates the first int(head_dim * rotary_fraction) dims of "
        "each head and passes the rest through (Phi-3 / Phi-4's partial_rotary_factor); must give an even "
        "count."
    )
    hf_model_type: str | None = Field(
        None, description="The Hugging Face model_type that exports (and PEFT adapters) use when none is "
        "asked for, where the flags alone do not decide the checkpoint layout: set by `lmforge import` for "
        "phi3 (fused qkv_proj / gate_up_proj); None: inferred from the flags."
    )

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (the first ones; with model.mla its rotary part)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.resolved_head_dim * self.rotary_fraction)

    @model_validator(mode="after")
    def _check_rope_area(self) -> ModelConfig:
        if self.pos_embedding != "rope" and self.rotary_fraction != 1.0:
            raise ValueError(f"rotary_fraction={self.rotary_fraction} needs pos_embedding=rope (this model "
                             f"has {self.pos_embedding} positions): leave it at 1.0")
        if self.rotary_fraction != 1.0 and (self.rotary_dim % 2 or self.rotary_dim == 0):
            raise ValueError(
                f"rotary_fraction={self.rotary_fraction} rotates {self.rotary_dim} of head_dim="
                f"{self.resolved_head_dim} dims; RoPE needs an even, nonzero count: choose a fraction whose "
                "product with head_dim is an even integer"
            )
        rs = self.rope_scaling
        if rs is not None and rs.type == "longrope":
            if rs.original_max_position_embeddings is None:
                raise ValueError("rope_scaling.type=longrope needs rope_scaling."
                                 "original_max_position_embeddings (the length past which the long factors "
                                 "apply, e.g. 4096)")
            half = self.rotary_dim // 2
            for key in ("short_factor", "long_factor"):
                got = getattr(rs, key)
                if got is None or len(got) != half:
                    raise ValueError(
                        f"rope_scaling.{key} must list one factor per rotary frequency: {half} values "
                        f"(rotary_dim {self.rotary_dim} / 2), got {'none' if got is None else len(got)}"
                    )
        return self
    # [issue-34 area: deepseek-mla]
    mla: MLAConfig | None = Field(
        None, description="Multi-head latent attention in place of every block's attention (None: "
        "grouped-query attention); n_kv_heads and head_dim then stay unset.")
    # [issue-34 area: gpt-oss]
    attn_sinks: bool = Field(
        False, description="A learned logit per query head that joins every attention softmax's denominator "
        "(a sink that adds no value: gpt-oss's sinks). Attention then runs as explicit maths (scores "
        "materialised), not through SDPA.")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") is not None:
            name = data["preset"]
            if not isinstance(name, str) or name not in PRESETS:
                raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(sorted(PRESETS))}")
            data = {**PRESETS[name], **data}
        return data

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={kv}")
        self._check_mla()
        if self.head_dim is None and self.mla is None and self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "change one of them or set head_dim"
            )
        if self.pos_embedding == "rope" and self.mla is None and self.resolved_head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.resolved_head_dim}")
        rs = self.rope_scaling
        if rs is not None and rs.type == "llama3" and rs.original_max_position_embeddings is None:
            raise ValueError("rope_scaling.type=llama3 needs rope_scaling.original_max_position_embeddings "
                             "(the context length the model was pre-trained with, e.g. 8192)")
        if self.arch == "encoder" and (self.pos_embedding != "learned" or not self.tie_embeddings):
            raise ValueError("model.arch=encoder needs pos_embedding=learned and tie_embeddings=true (the "
                             "BERT / RoBERTa layout)")
        self._check_qwen3_granite_smollm3()
        if self.quant is not None and self.quant.head and self.tie_embeddings:
            raise ValueError("quant.head=true quantizes an untied output head; this model ties it to the "
                             "embeddings (tie_embeddings=true), which stay in full precision: set "
                             "quant.head=false")
        if self.attn_sinks and self.arch == "encoder":
            raise ValueError("model.attn_sinks applies to the decoder's attention; model.arch=encoder has no "
                             "sinks: set attn_sinks=false")
        if self.attn_sinks and self.attn_logit_softcap is not None:
            raise ValueError(f"model.attn_sinks with attn_logit_softcap={self.attn_logit_softcap}: the sink "
                             "attention does not soft-cap its scores; unset one of them")
        self._check_gemma_olmo2()
        return self

    def _check_gemma_olmo2(self) -> None:
        """Impossible combinations of the norm-placement / Gemma fields (issue 34, gemma-olmo2 area)."""
        if self.norm_weight_offset != 0.0 and self.norm != "rmsnorm":
            raise ValueError(f"norm_weight_offset={self.norm_weight_offset} applies to RMSNorm; set "
                             "norm=rmsnorm or norm_weight_offset=0")
        types = self.layer_types
        if types is not None:
            if len(types) != self.n_layers:
                raise ValueError(f"layer_types has {len(types)} entries; it needs one per layer "
                                 f"(n_layers={self.n_layers})")
            if "sliding_attention" in types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is not set; "
                                 "set sliding_window to their window")
        if self.query_pre_attn_scalar is not None and self.attention_multiplier is not None:
            raise ValueError("query_pre_attn_scalar and attention_multiplier both set the attention scale; "
                             "set one of them")
        if self.rope_local_theta is not None and (types is None or "sliding_attention" not in types):
            raise ValueError("rope_local_theta is the RoPE base of sliding_attention layers; layer_types has "
                             "none: set layer_types or unset rope_local_theta")
        gemma = dict(norm_placement=self.norm_placement != "pre", norm_weight_offset=self.norm_weight_offset,
                     embed_scale=self.embed_scale, attn_logit_softcap=self.attn_logit_softcap,
                     final_logit_softcap=self.final_logit_softcap,
                     query_pre_attn_scalar=self.query_pre_attn_scalar, layer_types=self.layer_types)
        set_keys = [k for k, v in gemma.items() if v not in (None, False, 0.0)]
        if self.arch == "encoder" and (set_keys or self.mlp == "geglu"):
            raise ValueError(f"model.arch=encoder builds BERT's blocks, which do not take "
                             f"{', '.join(set_keys) or 'mlp=geglu'}: unset them")

    def _check_qwen3_granite_smollm3(self) -> None:
        if self.qk_norm_scope != "all" and not self.qk_norm:
            raise ValueError(f"model.qk_norm_scope={self.qk_norm_scope} chooses how q and k are normalised, "
                             "but model.qk_norm=false; set qk_norm=true or leave qk_norm_scope at all")
        bad = [i for i in self.nope_layers if not 0 <= i < self.n_layers]
        if bad:
            raise ValueError(f"model.nope_layers has {bad}, which are no layers of this model: indices run "
                             f"from 0 to n_layers-1={self.n_layers - 1}")
        if len(set(self.nope_layers)) != len(self.nope_layers):
            raise ValueError(f"model.nope_layers={self.nope_layers} lists a layer twice; list each once")
        if self.nope_layers and self.pos_embedding != "rope":
            raise ValueError("model.nope_layers turns RoPE off on some layers, but pos_embedding="
                             f"{self.pos_embedding}; set pos_embedding=rope or nope_layers=[]")

    def _check_mla(self) -> None:
        if self.moe is not None and self.moe.dense_layers > self.n_layers:
            raise ValueError(f"moe.dense_layers={self.moe.dense_layers} exceeds n_layers={self.n_layers}")
        if self.mla is None:
            return
        kv = None if self.n_kv_heads == self.n_heads else self.n_kv_heads  # = n_heads is no clash
        clashes = [f"{key}={value}" for key, value, off in (
            ("n_kv_heads", kv, None), ("head_dim", self.head_dim, None),
            ("pos_embedding", self.pos_embedding, "rope"), ("bias", self.bias, False),
            ("qkv_bias", self.qkv_bias, False), ("qk_norm", self.qk_norm, False),
            ("sliding_window", self.sliding_window, None), ("arch", self.arch, "decoder"),
            ("rotary_fraction", self.rotary_fraction, 1.0)) if value != off]
        if clashes:
            raise ValueError("model.mla (multi-head latent attention) sizes its heads with "
                             "mla.qk_nope_head_dim, qk_rope_head_dim and v_head_dim, uses RoPE, has biases "
                             "only through mla.attention_bias and no sliding window or q/k norm; unset: "
                             + ", ".join(clashes))

    @property
    def resolved_kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def resolved_head_dim(self) -> int:
        if self.mla is not None:  # the query/key head size (values have mla.v_head_dim)
            return self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim
        return self.head_dim or self.d_model // self.n_heads

    @property
    def resolved_d_ff(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp not in ("swiglu", "geglu"):
            return 4 * self.d_model
        hidden = int(2 * 4 * self.d_model / 3)
        return 64 * ((hidden + 63) // 64)


_DURATION = re.compile(r"(?:(\d+(?:\.\d*)?)h)?(?:(\d+(?:\.\d*)?)m)?(?:(\d+(?:\.\d*)?)s)?")


def parse_duration(text: str) -> float:
    """Seconds in "300", "90s", "5m", "1h30m", "2.5m"; a ValueError naming the accepted forms otherwise."""
    t = text.strip().lower().replace(" ", "")
    try:
        return float(t)
    except ValueError:
        pass
    m = _DURATION.fullmatch(t)
    if not t or m is None or not any(m.groups()):
        raise ValueError(f"{text!r} is not a duration: give seconds (300) or hours/minutes/seconds such as "
                         "'90s', '5m', '1h30m'")
    h, mins, secs = (float(g) if g else 0.0 for g in m.groups())
    return h * 3600 + mins * 60 + secs


# The suffix of the length keys of each schedule unit: warmup_steps, warmup_tokens, warmup_seconds, ...
UNIT_SUFFIX = {"steps": "steps", "tokens": "tokens", "time": "seconds"}


class ScheduleConfig(Section):
    """The learning-rate schedule. Lengths count optimizer steps (`*_steps` keys), tokens seen
    (`*_tokens` keys) or seconds of training (`*_seconds` keys, against train.max_time), as `unit`
    says; keys of another unit are errors, never silently ignored."""

    name: Literal[
        "cosine", "linear", "constant", "inverse_sqrt", "polynomial", "one_cycle", "wsd", "constant_cooldown"
    ] = Field(
        "cosine", description="Shape after warm-up: cosine, linear or polynomial decay to min_lr_ratio; "
        "constant; inverse_sqrt; one_cycle (torch OneCycleLR); wsd (warmup-stable-decay, as transformers); "
        "constant_cooldown (constant, then a cooldown at the end, Hägele et al. 2024)."
    )
    unit: Literal["steps", "tokens", "time"] = Field(
        "steps", description="What the schedule counts: optimizer steps, tokens seen (stays right when "
        "the batch size ramps up), or seconds of training against the wall-clock budget train.max_time "
        "(the lr at each step follows the time the run has trained so far, so the decay ends when the "
        "budget does)."
    )
    warmup_steps: int | None = Field(
        None, ge=0, description="Linear warm-up steps from 0 to the peak lr (None: 100; one_cycle: none)."
    )
    warmup_tokens: int | None = Field(
        None, ge=0, description="unit=tokens: linear warm-up tokens (0: none; one_cycle: leave unset)."
    )
    warmup_seconds: float | None = Field(
        None, ge=0.0, description="unit=time: linear warm-up over this many seconds of training (0: none; "
        "one_cycle: leave unset)."
    )
    min_lr_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="Final lr as a fraction of the peak (cosine, linear, polynomial, "
        "wsd, constant_cooldown)."
    )
    decay_steps: int | None = Field(
        None, ge=1, description="Step at which the decay (one_cycle: the cycle) ends (None: train.max_steps)."
    )
    decay_tokens: int | None = Field(
        None, ge=1, description="unit=tokens: tokens seen when the decay ends (None: all the run's tokens)."
    )
    decay_seconds: float | None = Field(
        None, gt=0.0, description="unit=time: seconds of training when the decay ends (None: train.max_time)."
    )
    power: float = Field(1.0, gt=0.0, description="polynomial: exponent of the decay (1: linear).")
    timescale_steps: int | None = Field(
        None, ge=1, description="inverse_sqrt: lr = peak / sqrt((step - warmup + t) / t) after warm-up "
        "(None: the warm-up length, or 10000 without warm-up)."
    )
    timescale_tokens: int | None = Field(
        None, ge=1, description="unit=tokens: inverse_sqrt timescale in tokens (None: warmup_tokens)."
    )
    timescale_seconds: float | None = Field(
        None, gt=0.0, description="unit=time: inverse_sqrt timescale in seconds (None: warmup_seconds)."
    )
    cooldown_fraction: float | None = Field(
        None, gt=0.0, le=1.0, description="wsd/constant_cooldown: the final decay spans this fraction of "
        "the schedule up to its decay end (None: 0.2, unless cooldown_steps/_tokens/_seconds is set)."
    )
    cooldown_steps: int | None = Field(
        None, ge=1, description="wsd/constant_cooldown: the final decay spans this many steps."
    )
    cooldown_tokens: int | None = Field(
        None, ge=1, description="unit=tokens: wsd/constant_cooldown final decay length in tokens."
    )
    cooldown_seconds: float | None = Field(
        None, gt=0.0, description="unit=time: wsd/constant_cooldown final decay length in seconds."
    )
    decay_shape: Literal["linear", "cosine", "1-sqrt"] = Field(
        "1-sqrt", description="wsd/constant_cooldown: shape of the final decay (constant_cooldown: linear "
        "or 1-sqrt)."
    )
    pct_start: float = Field(
        0.3, gt=0.0, lt=1.0, description="one_cycle: fraction of the cycle spent rising to the peak lr."
    )
    div_factor: float = Field(25.0, ge=1.0, description="one_cycle: the cycle starts at peak / div_factor.")
    final_div_factor: float = Field(
        1e4, ge=1.0, description="one_cycle: the cycle ends at peak / (div_factor * final_div_factor)."
    )

    @model_validator(mode="after")
    def _check_combination(self) -> ScheduleConfig:
        own = UNIT_SUFFIX[self.unit]
        for key in ("warmup", "decay", "cooldown", "timescale"):
            for unit, suffix in UNIT_SUFFIX.items():
                if unit != self.unit and getattr(self, f"{key}_{suffix}") is not None:
                    raise ValueError(f"schedule.{key}_{suffix} counts {suffix} but schedule.unit="
                                     f"{self.unit}; use schedule.{key}_{own} or set schedule.unit={unit}")
        warmup, decay = getattr(self, f"warmup_{own}"), getattr(self, f"decay_{own}")
        cooldown = getattr(self, f"cooldown_{own}")
        if self.name == "one_cycle" and warmup:
            raise ValueError(f"schedule.name=one_cycle rises from peak/div_factor over pct_start of the "
                             f"cycle; remove schedule.warmup_{own} (or set it to 0) and tune "
                             "schedule.pct_start")
        if self.unit != "steps" and warmup is None and self.name != "one_cycle":
            raise ValueError(f"schedule.unit={self.unit} needs schedule.warmup_{own} ({own} of linear "
                             "warm-up; 0 for none)")
        if decay is not None and self.name in ("constant", "inverse_sqrt"):
            raise ValueError(f"schedule.name={self.name} never ends a decay; remove schedule.decay_{own}")
        if decay is not None and warmup is not None and decay <= warmup:
            raise ValueError(f"schedule.decay_{own}={decay} must exceed schedule.warmup_{own}={warmup}: "
                             "the decay ends after the warm-up")
        set_cooldown = [k for k in (f"cooldown_{own}", "cooldown_fraction") if getattr(self, k) is not None]
        if set_cooldown and self.name not in ("wsd", "constant_cooldown"):
            raise ValueError(f"schedule.{set_cooldown[0]} applies to name=wsd or constant_cooldown, "
                             f"not {self.name}")
        if len(set_cooldown) == 2:
            raise ValueError(f"set one of schedule.cooldown_{own} and schedule.cooldown_fraction, not both")
        if cooldown is not None and decay is not None and cooldown + (warmup or 0) > decay:
            raise ValueError(f"schedule.cooldown_{own}={cooldown} does not fit between the warm-up "
                             f"({warmup or 0}) and schedule.decay_{own}={decay}; shorten it or raise "
                             f"schedule.decay_{own}")
        if getattr(self, f"timescale_{own}") is not None and self.name != "inverse_sqrt":
            raise ValueError(f"schedule.timescale_{own} applies to name=inverse_sqrt, not {self.name}")
        if (self.name == "inverse_sqrt" and self.unit != "steps" and not warmup
                and getattr(self, f"timescale_{own}") is None):
            raise ValueError(f"schedule.name=inverse_sqrt with unit={self.unit} and no warm-up needs "
                             f"schedule.timescale_{own} (the {own} over which the lr falls to 1/sqrt(2))")
        if self.name == "constant_cooldown" and self.decay_shape == "cosine":
            raise ValueError("schedule.name=constant_cooldown cools down as linear or 1-sqrt; set "
                             "schedule.decay_shape to one of those, or use name=wsd for a cosine decay")
        return self


class TrainConfig(Section):
    max_steps: int = Field(1000, ge=1, description="Optimizer steps to train.")
    max_time: float | None = Field(
        None, gt=0.0, description="Wall-clock budget of training, in seconds or as '90s', '5m', '1h30m' "
        "(None: none). The run stops before a step that would end past it, saves a checkpoint and runs the "
        "final evaluation; validations, task evaluations and checkpoint saves do not count against it. "
        "train.max_steps still applies (set it high for a run that only the clock ends), and "
        "schedule.unit=time spreads the schedule over the budget."
    )
    micro_batch_size: int = Field(8, ge=1, description="Sequences per forward/backward pass.")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-batches accumulated per optimizer step.")
    seq_len: int | None = Field(None, ge=1, description="Training sequence length (None: model.max_seq_len).")
    grad_clip: float = Field(1.0, ge=0.0, description="Clip gradients to this global norm (0: off).")
    grad_clip_value: float = Field(
        0.0, ge=0.0, description="Clamp every gradient element to [-v, v] before the norm clip (0: off)."
    )
    log_group_stats: bool = Field(
        True, description="Log per-group gradient norms and update/parameter norm ratios at log steps."
    )
    batch_warmup_tokens: int = Field(
        0, ge=0, description="Ramp tokens per optimizer step linearly over this many tokens (0: off)."
    )
    batch_warmup_start_tokens: int | None = Field(
        None, ge=1, description="Tokens per step at the start of the ramp (None: one micro-batch per rank)."
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="fp32, bf16/fp16 autocast; auto measures what is fast on this device."
    )
    activation_checkpointing: Literal["none", "full", "every_k", "selective"] = Field(
        "none", description="Recompute activations in backward: in no block, every block, every k-th; "
        "selective: in every block, only the cheap ops (matmul and attention outputs are kept)."
    )
    ac_every: int = Field(2, ge=1, description="k for activation_checkpointing=every_k.")
    ac_save: Literal["all_matmuls", "alternate_matmuls"] = Field(
        "all_matmuls", description="activation_checkpointing=selective keeps every matmul's output, or "
        "every second one (torchtitan's rule: less memory, half the matmuls redone)."
    )
    compile: bool = Field(False, description="torch.compile the model.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Device (auto: cuda if available).")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None: torch's default).")
    keep_host_memory: bool = Field(
        True, description="While training, keep freed host memory for reuse instead of returning it to the "
        "OS (glibc on Linux; elsewhere nothing changes): steps then allocate without page faults (1.0-1.17x "
        "faster CPU steps, the more the larger a step's temporaries: bench/host_memory.py), and the process "
        "holds its peak memory until training ends."
    )
    log_every: int = Field(10, ge=1, description="Log metrics every this many steps.")
    eval_every: int = Field(200, ge=0, description="Validate every this many steps (0: only at the end).")
    eval_batches: int = Field(20, ge=1, description="Validation micro-batches per evaluation.")
    eval_tasks: list[str] = Field(
        default_factory=list, description="Task evaluation at every validation: task files in "
        "lm-evaluation-harness's YAML format, dirs of them, or builtin:code (lmforge eval --tasks); the "
        "scores are logged as task/<task>/<metric> (metrics.jsonl, TensorBoard)."
    )
    eval_tasks_limit: float | None = Field(
        200, gt=0, description="Documents per task at each task evaluation (below 1: that fraction of "
        "each task; None: all of them)."
    )
    loss_chunk_tokens: int = Field(
        0, ge=0, description="Compute the output projection and cross-entropy this many tokens at a time, "
        "never holding all (tokens x vocab) logits (0: off; e.g. 4096 saves memory at large vocabularies)."
    )

    @field_validator("max_time", mode="before")
    @classmethod
    def _parse_duration(cls, value: Any) -> Any:
        return parse_duration(value) if isinstance(value, str) else value


class MLMConfig(Section):
    """Masked-LM corruption (objective mlm), BERT's recipe: of the positions picked, replace 80% by the
    mask token, 10% by a random token, keep 10%; the loss is over the picked positions only."""

    mask_prob: float = Field(0.15, gt=0.0, lt=1.0, description="Fraction of (non-special) positions picked.")
    replace_prob: float = Field(0.8, ge=0.0, le=1.0, description="Of the picked: replaced by the mask token.")
    random_prob: float = Field(0.1, ge=0.0, le=1.0, description="Of the picked: replaced by a random token "
                               "(the rest are kept as they are).")
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="Seed of the masks (None: run.seed); each "
                             "row's mask is a function of this seed and the row's tokens.")

    @model_validator(mode="after")
    def _check_split(self) -> MLMConfig:
        if self.replace_prob + self.random_prob > 1.0:
            raise ValueError(f"mlm.replace_prob + mlm.random_prob = {self.replace_prob + self.random_prob:g} "
                             "exceeds 1 (the rest, kept unchanged, cannot be negative)")
        return self


class DistillConfig(Section):
    """Knowledge distillation (objective distill): the teacher and how its distributions are matched."""

    teacher: str | None = Field(
        None, description="The teacher: a run dir, checkpoint dir or Hugging Face dir (a quantized run "
        "too) whose vocabulary is the student's; required by objective distill."
    )
    teacher_weights: Literal["model", "ema", "swa"] = Field(
        "model", description="The teacher run's trained weights or their EMA / SWA average."
    )
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = Field(
        "forward_kl", description="forward_kl: KL(teacher || student) (Hinton); reverse_kl: KL(student || "
        "teacher) (MiniLLM); jsd: generalised Jensen-Shannon with distill.beta (GKD)."
    )
    temperature: float = Field(
        1.0, gt=0.0, description="Both logits are divided by it; the divergence is scaled by its square."
    )
    beta: float = Field(
        0.5, ge=0.0, le=1.0, description="jsd: the teacher's weight in the mixture (0: forward KL, 1: "
        "reverse KL), TRL's convention."
    )
    kd_ratio: float = Field(
        0.5, ge=0.0, le=1.0, description="loss = kd_ratio * divergence + (1 - kd_ratio) * cross-entropy "
        "on the data's tokens."
    )
    topk_cache: str | None = Field(
        None, description="A teacher top-k cache dir (lmforge distill --precompute-topk writes it): the "
        "teacher's k largest logits of every row the run reads, instead of running the teacher each step "
        "(forward_kl only)."
    )
    topk: int = Field(32, ge=1, description="Logits per position kept by --precompute-topk.")


class SFTConfig(Section):
    """Supervised fine-tuning data: conversations, their chat template, which tokens carry the loss."""

    data: list[str] = Field(
        default_factory=list, description="Chat data: .jsonl / .parquet files, folders of them, or a saved "
        "`datasets` dir (messages, prompt/completion, Alpaca or ShareGPT records; messages records may use "
        "tools: 'tools', assistant 'tool_calls', role 'tool')."
    )
    val_data: list[str] = Field(
        default_factory=list, description="Held-out chat data (empty: sft.val_fraction of sft.data)."
    )
    val_fraction: float = Field(
        0.05, ge=0.0, lt=1.0, description="Fraction of the conversations held out for validation."
    )
    format: Literal["auto", "messages", "prompt_completion", "alpaca", "sharegpt"] = Field(
        "auto", description="Record shape (auto: told apart record by record)."
    )
    template: str = Field(
        "auto", description="Chat template: auto (the tokenizer's own from tokenizer_config.json, else "
        "chatml), chatml (lmforge's, adds <|im_start|>/<|im_end|> to the tokenizer), or a .jinja file."
    )
    loss_on: Literal["assistant", "last", "all"] = Field(
        "assistant", description="Tokens that carry the loss: every assistant turn (for prompt/completion "
        "records, the completion only), the last assistant turn, or every token."
    )
    packing: bool = Field(
        True, description="Pack several conversations per sequence (best-fit decreasing; attention never "
        "crosses a conversation, positions restart); false: one per sequence, padded."
    )
    overlong: Literal["truncate", "drop"] = Field(
        "truncate", description="A conversation longer than train.seq_len: keep its start, or drop it."
    )
    on_bad_record: Literal["skip", "fail"] = Field(
        "skip", description="A malformed record: skip and count it, or stop with its file and line."
    )
    template_kwargs: dict[str, str | bool | int | float | None] = Field(
        default_factory=dict, description="Extra variables the chat template is rendered with, as "
        "transformers' apply_chat_template(**kwargs) passes them (Qwen3: {enable_thinking: false}); "
        "honoured by sft, generate --chat and serve."
    )

    @field_validator("template_kwargs", mode="before")
    @classmethod
    def _simple_template_kwargs(cls, v: Any) -> Any:
        # One clear message rather than one per member of the value union.
        if not isinstance(v, dict):
            raise ValueError(f"must be a mapping of variable names to values, got {type(v).__name__}")
        for name, value in v.items():
            if value is not None and not isinstance(value, (str, bool, int, float)):
                raise ValueError(f"{name!r} is {type(value).__name__}; a template variable here is a string, "
                                 "number, boolean or null")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name!r} is {value}; a number here must be a finite number")
        return v

    @field_validator("template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, v: dict) -> dict:
        reserved = {"messages", "add_generation_prompt", "range", "tools"}  # tools: each record's own
        for name in v:
            if not name.isidentifier() or name in reserved or name.startswith("_"):
                raise ValueError(f"sft.template_kwargs has {name!r}, which cannot be a template variable: "
                                 "give identifiers other than messages, add_generation_prompt, range, tools "
                                 "(a record's own 'tools') and names starting with _")
        return v


class PreferenceConfig(Section):
    """Preference optimisation (objective dpo): the pairs and the loss. The chat template, the record
    checks and what happens to sequences longer than train.seq_len are the sft section's settings."""

    data: list[str] = Field(
        default_factory=list, description="Preference pairs: .jsonl / .parquet files, folders of them or a "
        "saved `datasets` dir, in TRL's shapes: prompt/chosen/rejected as strings or message lists, or "
        "chosen/rejected whole conversations sharing their prompt (`lmforge tasks --pairs` writes some)."
    )
    val_data: list[str] = Field(
        default_factory=list, description="Held-out pairs (empty: preference.val_fraction of the data)."
    )
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="Fraction of the pairs held out.")
    loss: Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "orpo", "kto"] = Field(
        "sigmoid", description="sigmoid: DPO (conservative DPO with label_smoothing > 0); ipo; hinge (SLiC); "
        "robust: rDPO; simpo and orpo need no reference model; kto: KTO on unpaired records (prompt, "
        "completion, label: `lmforge tasks --unpaired` writes some). The formulas are TRL's."
    )
    precompute_reference: bool = Field(
        False, description="Compute the reference model's log-probs of every pair once before training (and "
        "again on resume), then free the reference: full fine-tuning keeps no frozen copy in memory while it "
        "trains, LoRA skips a forward per step. Not with loss kto (its reference point pairs examples of a "
        "batch)."
    )
    desirable_weight: float = Field(1.0, gt=0.0, description="KTO: weight of the desirable examples' loss.")
    undesirable_weight: float = Field(1.0, gt=0.0, description="KTO: weight of the undesirable examples' "
                                      "loss (TRL: keep desirable_weight x #desirable / (undesirable_weight x "
                                      "#undesirable) within [1, 4/3]).")
    beta: float = Field(0.1, gt=0.0, description="Strength of the KL tie to the reference (DPO's beta; IPO's "
                        "tau; SimPO's and ORPO's beta / lambda).")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="Assumed fraction of flipped labels "
                                   "(sigmoid: conservative DPO; robust; simpo).")
    simpo_gamma: float = Field(0.5, ge=0.0, description="SimPO's target reward margin.")
    sft_weight: float = Field(0.0, ge=0.0, description="Add this times the chosen completion's token-mean "
                              "NLL to each pair's loss (RPO, Pang et al. 2024; TRL's loss_type [..., 'sft']: "
                              "keeps DPO from lowering the chosen answers' likelihood with the rejected).")
    center_rewards_coefficient: float = Field(
        0.0, ge=0.0, description="Reward models: add this times (r_chosen + r_rejected)^2 to each pair's "
        "loss, which keeps the scores centred on 0 (TRL's center_rewards_coefficient; 0: off)."
    )


class RLConfig(Section):
    """Reinforcement learning (objective rl): prompts, how completions are sampled for them and scored,
    and the policy-gradient loss. train.micro_batch_size counts prompts; each brings group_size
    completions. The chat template and the record checks are the sft section's settings."""

    data: list[str] = Field(
        default_factory=list, description="Prompts: .jsonl / .parquet files, folders of them or a saved "
        "`datasets` dir; each record a 'prompt' (string or messages) or chat 'messages', and the 'answer' "
        "rewards check against (`lmforge tasks` writes such records)."
    )
    val_data: list[str] = Field(default_factory=list, description="Held-out prompts (empty: rl.val_fraction "
                                "of the data). Validation scores the greedy reply to each.")
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="Fraction of the prompts held out.")
    algorithm: Literal["grpo", "rloo", "ppo"] = Field(
        "grpo", description="grpo: group-normalised advantages and a clipped per-token loss (TRL's "
        "GRPOTrainer); rloo: leave-one-out baselines and a clipped sequence-level loss, its KL penalty in "
        "the reward (TRL's RLOOTrainer); ppo: a value head on the policy, per-token KL-penalty rewards, "
        "GAE advantages, the clipped policy and value losses."
    )
    group_size: int = Field(8, ge=1, description="Completions sampled per prompt (TRL's num_generations; "
                            "grpo and rloo need 2 or more, ppo takes 1).")
    iterations: int = Field(1, ge=1, description="Optimizer steps on each sampled batch (TRL's "
                            "num_iterations, the GRPO paper's mu, PPO epochs): a step's completions, "
                            "rewards, advantages and reference log-probs train this many consecutive steps, "
                            "clipped against the sampling policy's log-probs; its prompts count once.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="PPO: discount of GAE.")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="PPO: GAE's lambda.")
    vf_coef: float = Field(0.1, ge=0.0, description="PPO: weight of the value loss.")
    cliprange_value: float | None = Field(0.2, gt=0.0, description="PPO: clip range of the value around the "
                                          "sampling-time value (None: unclipped).")
    max_new_tokens: int = Field(32, ge=1, description="Longest completion (TRL's max_completion_length).")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature of the completions.")
    top_k: int | None = Field(None, ge=1, description="Sample from the k most likely tokens only.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    rewards: dict[Literal["exact_match", "format", "reward_model"], float] = Field(
        default_factory=lambda: {"exact_match": 1.0}, description="Reward functions and their weights, "
        "summed: exact_match (1 when the reply's answer equals the record's 'answer', by the shipped task's "
        "checker when the record names one), format (1 when the reply is one line and ends its turn), "
        "reward_model (the score of rl.reward_model for prompt + reply)."
    )
    reward_model: str | None = Field(None, description="A reward model (an `lmforge reward` run or "
                                     "checkpoint dir) scoring each prompt + completion, for "
                                     "rewards.reward_model; it must use the policy's tokenizer.")
    scale_rewards: Literal["group", "batch", "none"] | None = Field(
        None, description="Divide advantages by the std of the group (grpo's default), of the whole batch, "
        "or not at all (Dr. GRPO; rloo's default). rloo takes none or batch (whitening)."
    )
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                              "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="How grpo's per-token losses become one (verl's names): token-mean over "
        "the step's completion tokens (TRL dapo, the default), seq-mean-token-mean (TRL grpo), "
        "seq-mean-token-sum, seq-mean-token-sum-norm (Dr. GRPO: token sums / max_new_tokens)."
    )
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0, description="PPO clip range of the probability ratio.")
    clip_eps_high: float | None = Field(None, gt=0.0, description="Upper clip range (DAPO's clip-higher, "
                                        "e.g. 0.28); unset: clip_eps.")
    beta: float = Field(0.0, ge=0.0, description="KL penalty towards the reference model (the starting "
                        "model; 0 needs none). grpo adds beta x KL per token; rloo subtracts beta x the "
                        "sequence's summed log-ratio from its reward.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="grpo's per-token KL estimate "
                                                    "(k3: Schulman's, unbiased and >= 0).")

    @model_validator(mode="after")
    def _check(self) -> RLConfig:
        if self.algorithm != "ppo" and self.group_size < 2:
            raise ValueError(f"rl.group_size={self.group_size}: {self.algorithm} compares completions of a "
                             "prompt with each other and needs 2 or more")
        if self.algorithm == "rloo" and self.scale_rewards == "group":
            raise ValueError("rl.scale_rewards=group is for grpo; rloo's leave-one-out baseline takes none "
                             "or batch")
        if not self.rewards or any(w == 0 for w in self.rewards.values()):
            raise ValueError("rl.rewards needs at least one reward function with a non-zero weight")
        if ("reward_model" in self.rewards) != (self.reward_model is not None):
            raise ValueError("rl.rewards.reward_model and rl.reward_model go together: the weight of the "
                             "reward model's score, and the reward model (an `lmforge reward` run dir)")
        return self

    @property
    def reward_scaling(self) -> str:
        return self.scale_rewards or ("group" if self.algorithm == "grpo" else "none")


class FinetuneConfig(Section):
    """Which weights train: all of them, or low-rank adapters on a frozen (optionally 4-bit) base."""

    method: Literal["full", "lora", "dora", "qlora"] = Field(
        "full", description="full: every weight; lora: low-rank adapters, base frozen; dora: weight-"
        "decomposed LoRA; qlora: LoRA on a base quantised to NF4 with double quantisation."
    )
    r: int = Field(8, ge=1, description="LoRA rank.")
    alpha: float = Field(16.0, gt=0.0, description="LoRA alpha: the update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the input of the adapter path.")
    rslora: bool = Field(False, description="Rank-stabilised scaling alpha / sqrt(r) (Kalajdzievski 2023).")
    targets: list[str] = Field(
        default_factory=lambda: ["all-linear"], description="Linear layers that get adapters: all-linear, "
        "names (wq, w_down), globs (layers.*.attn.wq) or Hugging Face names (q_proj, down_proj)."
    )
    quant_blocksize: int = Field(64, ge=16, description="qlora: weights per NF4 quantisation block.")
    train_tokens: list[int] = Field(
        default_factory=list, description="Token ids whose embedding (and untied output) rows train beside "
        "the adapters (PEFT's trainable_token_indices); a chat template's added tokens are put here."
    )
    init_adapter: str | None = Field(
        None, description="Start from these adapters (a PEFT adapter dir: adapter_config.json + "
        "adapter_model.safetensors) instead of fresh ones; r, alpha and targets then come from it."
    )


class CheckpointConfig(Section):
    every: int = Field(500, ge=0, description="Save a checkpoint every this many steps (0: only at the end).")
    keep_last: int = Field(3, ge=1, description="Keep this many most recent checkpoints.")
    save_final: bool = Field(True, description="Save a checkpoint when training ends.")
    keep_best: bool = Field(
        False, description="Also keep the checkpoint with the lowest validation loss (checkpoints/best)."
    )


class ParallelConfig(Section):
    """Layout of a distributed run: dp_replicate x dp_shard x tp x pp must equal the process count."""

    dp_replicate: int = Field(
        1, ge=1, description="Data-parallel replicas: DDP, or HSDP's replicate dim (with tp/pp/dp_shard > 1)."
    )
    dp_shard: int = Field(
        -1, ge=-1, description="Data-parallel shard degree for FSDP (-1: whatever the other degrees leave)."
    )
    tp: int = Field(1, ge=1, description="Tensor-parallel degree (heads and MLP width split).")
    pp: int = Field(1, ge=1, description="Pipeline-parallel stages (layers split).")
    ep: int = Field(
        1, ge=1, description="Expert-parallel degree (model.moe): each group of ep data-parallel ranks "
        "splits the experts and exchanges tokens all-to-all; must divide dp_replicate x dp_shard."
    )
    zero: Literal[1, 2, 3] = Field(
        3, description="With dp_shard > 1: 3 shards params+grads+optimizer (FSDP2), 2 also but keeps params "
        "gathered from forward to backward, 1 shards optimizer state only (DDP + ZeroRedundancyOptimizer; "
        "tp = pp = 1)."
    )
    sequence_parallel: bool = Field(
        True, description="With tp > 1: shard norms and residuals on the sequence."
    )
    cpu_offload: bool = Field(
        False, description="FSDP: keep sharded params, grads and optimizer state on CPU."
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field(
        "1f1b", description="Pipeline schedule."
    )
    pp_microbatches: int | None = Field(
        None, ge=1, description="Pipeline micro-batches per step (None: train.grad_accum_steps)."
    )
    pp_stages_per_rank: int = Field(
        1, ge=1, description="Model chunks per rank: 1 for gpipe/1f1b, >= 2 for interleaved_1f1b."
    )
    param_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="FSDP compute dtype of params (auto: bf16 with bf16 precision, else fp32)."
    )
    reduce_dtype: Literal["fp32", "bf16"] = Field("fp32", description="FSDP gradient reduce dtype.")
    timeout_s: int = Field(
        600, ge=10, description="Collective timeout: a dead rank stops the job after this."
    )


class StabilityConfig(Section):
    max_nonfinite: int = Field(
        5, ge=1, description="Stop (with a checkpoint) after this many consecutive steps with NaN/Inf "
        "loss or gradients; each one is skipped, never applied."
    )
    spike_detection: bool = Field(False, description="Detect loss spikes (robust z-score) and recover.")
    spike_window: int = Field(
        50, ge=5, description="Trailing steps the median/MAD of the loss is taken over."
    )
    spike_min_history: int = Field(20, ge=3, description="Steps of history before spikes are judged.")
    spike_z: float = Field(
        6.0, gt=0.0, description="Robust z-score (0.6745*(x-median)/MAD) that counts as a spike."
    )
    spike_action: Literal["rollback", "skip", "log"] = Field(
        "rollback", description="rollback: reload the last good checkpoint and skip the data since; "
        "skip: drop this update only; log: record the event and go on."
    )
    spike_lr_factor: float = Field(
        1.0, gt=0.0, le=1.0, description="Multiply the lr by this after each recovery (1: unchanged)."
    )
    spike_max_recoveries: int = Field(
        5, ge=0, description="Give up (stop with an error) after this many recoveries."
    )
    early_stopping_patience: int = Field(
        0, ge=0, description="Stop when val_loss has not improved for this many evaluations (0: off)."
    )
    early_stopping_min_delta: float = Field(
        0.0, ge=0.0, description="Improvement that counts for early stopping."
    )


class AveragingConfig(Section):
    ema: bool = Field(False, description="Keep an exponential moving average of the weights.")
    ema_decay: float = Field(0.999, gt=0.0, lt=1.0, description="EMA decay per update.")
    ema_every: int = Field(1, ge=1, description="Update the EMA every this many steps.")
    swa: bool = Field(False, description="Keep a stochastic weight average (equal-weight mean of snapshots).")
    swa_start: int = Field(0, ge=0, description="First step that enters the SWA mean.")
    swa_every: int = Field(10, ge=1, description="Add a snapshot to the SWA mean every this many steps.")
    eval_averaged: bool = Field(
        True, description="Also report val loss of the EMA/SWA weights at each evaluation."
    )


class MlflowConfig(Section):
    enabled: bool = Field(False, description="Log config, metrics and final artifacts to MLflow "
                          "(needs `lmforge[mlflow]`).")
    tracking_uri: str | None = Field(None, description="MLflow tracking URI (file:/path/mlruns or "
                                     "http://host:port); unset: file:<run.dir>/mlruns.")
    experiment: str = Field("lmforge", min_length=1, description="MLflow experiment name (created if new).")
    run_name: str | None = Field(None, description="MLflow run name; unset: run.name.")


class WandbConfig(Section):
    enabled: bool = Field(False, description="Log config, metrics and final artifacts to Weights & Biases "
                          "(needs `lmforge[wandb]`).")
    project: str = Field("lmforge", min_length=1, description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (user or team); unset: your default.")
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: write the run locally (upload later with `wandb sync`); "
        "online: stream to the W&B server (needs `wandb login`).")
    dir: str | None = Field(None, description="Where W&B writes its wandb/ folder; unset: run.dir.")
    run_name: str | None = Field(None, description="W&B run name; unset: run.name.")


class LoggingConfig(Section):
    progress: Literal["auto", "bar", "plain", "none"] = Field(
        "auto", description="Console output: a live bar, one line per log step, or nothing."
    )
    tensorboard: bool = Field(False, description="Also write TensorBoard events (needs `tensorboard`).")
    plot: bool = Field(True, description="Draw loss/lr curves to <run.dir>/curves.png.")
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig, description="MLflow tracking (rank 0 only).")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases tracking "
                               "(rank 0 only).")


class EvalConfig(Section):
    split: Literal["val", "train"] = Field("val", description="Split to evaluate.")
    max_batches: int | None = Field(None, ge=1, description="Evaluate at most this many batches.")
    batch_size: int = Field(8, ge=1, le=4096, description="Sequences per evaluation batch.")


class GenerateConfig(Section):
    prompt: str = Field("", description="Text to continue.")
    max_new_tokens: int = Field(200, ge=1, description="Tokens to generate.")
    temperature: float = Field(0.8, ge=0.0, description="Sampling temperature (0: greedy).")
    top_k: int | None = Field(None, ge=1, description="Sample from the k most likely tokens.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    num_samples: int = Field(1, ge=1, le=1024, description="Independent samples (one batch: a KV-cache "
                             "row each).")
    seed: int = Field(0, ge=0, le=SEED_MAX, description="Sampling seed.")


class Config(Section):
    """The whole run: what `lmforge <verb> -c run.yaml` reads."""

    run: RunConfig = Field(default_factory=RunConfig, description="Run identity and directory.")
    data: DataConfig = Field(default_factory=DataConfig, description="Text sources and preparation.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Model architecture.")
    optim: OptimConfig = Field(default_factory=AdamWConfig, description="Optimizer: optim.name picks one; "
                               "its own settings sit in optim.<name>.")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="Learning-rate schedule.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training loop.")
    objective: ObjectiveConfig = Field(default_factory=CausalLMObjective, description="Training method: "
                                     "objective.name picks one (causal_lm, sft, dpo, reward, rl, distill, "
                                     "mlm); its settings sit in its own section.")
    sft: SFTConfig = Field(default_factory=SFTConfig,
                           description="Supervised fine-tuning data (objective sft).")
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig,
                                         description="Preference pairs and loss (objective dpo).")
    rl: RLConfig = Field(default_factory=RLConfig, description="RL prompts, sampling, rewards and loss "
                         "(objective rl).")
    distill: DistillConfig = Field(default_factory=DistillConfig,
                                   description="Teacher and losses of knowledge distillation (objective "
                                   "distill).")
    mlm: MLMConfig = Field(default_factory=MLMConfig, description="Masking of objective mlm.")
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig,
                                     description="Full fine-tuning or LoRA / DoRA / QLoRA adapters.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpointing.")
    stability: StabilityConfig = Field(default_factory=StabilityConfig,
                                       description="Non-finite guard, loss-spike recovery, early stopping.")
    averaging: AveragingConfig = Field(default_factory=AveragingConfig, description="Weight EMA and SWA.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Distributed layout.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Logging.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="`lmforge eval` settings.")
    generate: GenerateConfig = Field(default_factory=GenerateConfig,
                                     description="`lmforge generate` settings.")
    curate: CurateConfig = Field(default_factory=CurateConfig,
                                 description="`lmforge data` corpus-cleaning pipeline.")

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        seq = self.train.seq_len
        if seq is not None and seq > self.model.max_seq_len:
            raise ValueError(
                f"train.seq_len={seq} exceeds model.max_seq_len={self.model.max_seq_len}; "
                "lower train.seq_len or raise model.max_seq_len"
            )
        if self.schedule.unit == "time" and self.train.max_time is None:
            raise ValueError("schedule.unit=time spreads the schedule over the wall-clock budget: set "
                             "train.max_time (e.g. 5m), or count steps or tokens (schedule.unit)")
        check_arch(self.objective.name, self.model.arch)
        return self

    @property
    def seq_len(self) -> int:
        return self.train.seq_len or self.model.max_seq_len
