"""The `model` section: the architecture (blocks, attention, positions, MoE, MLA, quantized weights)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from lmforge.config.presets import PRESETS
from lmforge.config.section import Section


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
    pos_embedding: Literal["rope", "learned", "relative"] = Field(
        "rope", description="Rotary position embedding, a learned absolute position table, or T5's bucketed "
        "relative position bias (relative: model.arch=t5 only, and its default there)."
    )
    block_position_embedding: bool = Field(
        False, description="GLM's second position (objective glm): a learned table of max_seq_len rows, "
        "indexed by each token's position inside its blank (0 for ordinary text), added to the token "
        "embeddings; the first position stays pos_embedding's. No Hugging Face family has it: export refuses."
    )
    rope_theta: float = Field(10000.0, gt=0.0, description="RoPE base frequency.")
    mlp: Literal["swiglu", "gelu", "gelu_tanh", "geglu", "relu"] = Field(
        "swiglu", description="MLP type: SwiGLU (Llama), GELU (erf), GELU tanh approximation (GPT-2), "
        "GeGLU (Gemma; T5 v1.1 / Flan's gated-gelu: a gate through GELU's tanh approximation), or ReLU "
        "(T5 1.0; model.arch=t5 only, and its default there)."
    )
    bias: bool = Field(False, description="Biases in every linear layer and in LayerNorm (GPT-2 style).")
    qkv_bias: bool = Field(False, description="Biases in the q/k/v projections only (Qwen2 style).")
    qk_norm: bool = Field(False, description="RMSNorm over the whole q and k projections before RoPE "
                          "(OLMoE / OLMo-2 style).")
    tie_embeddings: bool = Field(True, description="Share the input embedding and output projection.")
    score_head: bool = Field(False, description="A scalar head `score` (d_model -> 1, no bias) beside the "
                             "output projection: a reward model (objective reward) reads it at a sequence's "
                             "last token; exported as ...ForSequenceClassification with num_labels 1.")
    num_labels: int = Field(1, ge=1, le=1000, description="Outputs of the score head (model.score_head): 1 "
                            "for a reward model or a regressor, the classes of a classifier (objective "
                            "classify sets it from classify.num_labels).")
    score_reads: Literal["sequence", "token", "span"] = Field(
        "sequence", description="What the score head (model.score_head) reads: sequence (a reward model's or "
        "classifier's summary of the text: a decoder's last token, an encoder's pooled [CLS]), token (a "
        "tagger's num_labels outputs on every token, with a bias: ...ForTokenClassification) or span (an "
        "extractive reader's start and end logits on every token: ...ForQuestionAnswering).")
    arch: Literal["decoder", "encoder", "t5"] = Field(
        "decoder", description="decoder: causal LM (models/transformer.py); encoder: bidirectional masked LM "
        "(models/encoder.py: BERT / RoBERTa layout, post-norm blocks, an MLM head; objective mlm); t5: "
        "encoder-decoder (models/t5.py: T5's relative position buckets, RMS norms, cross-attention; "
        "n_layers encoder blocks and n_decoder_layers decoder blocks)."
    )
    # [issue-37 area: t5] the encoder-decoder's own fields (models/t5.py); refused with any other arch
    n_decoder_layers: int | None = Field(
        None, ge=1, description="t5: decoder blocks (None: n_layers, which counts the encoder's); HF "
        "num_decoder_layers.")
    relative_attention_num_buckets: int = Field(
        32, ge=2, description="t5: relative position buckets of the attention bias (half each way in the "
        "encoder, all backwards in the decoder); HF relative_attention_num_buckets.")
    relative_attention_max_distance: int = Field(
        128, ge=2, description="t5: distances from this on share the last bucket; HF "
        "relative_attention_max_distance.")
    scale_decoder_output: bool | None = Field(
        None, description="t5: multiply the decoder output by d_model**-0.5 before the head (None: exactly "
        "when tie_embeddings, as T5 1.0 ties and rescales and v1.1 / Flan neither).")
    decoder_start_token_id: int = Field(
        0, ge=0, description="t5: the token the decoder starts from (T5: the padding id 0); HF "
        "decoder_start_token_id.")
    type_vocab_size: int = Field(2, ge=0, description="encoder: rows of the token-type (segment) embedding "
                                 "(BERT 2, RoBERTa 1, 0: none).")
    position_offset: int = Field(0, ge=0, description="encoder: learned positions start at this row and "
                                 "count the tokens that are not id offset-1 (padding, which sits at row "
                                 "offset-1): RoBERTa's padding_idx + 1; BERT: 0, positions 0..T-1.")
    value_head: bool = Field(False, description="A scalar head `value` (d_model -> 1, no bias): PPO's critic "
                             "on the policy's own hidden states (objective rl, rl.algorithm=ppo); not "
                             "exported.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on attention, residual and embeddings "
                           "(each overridable by attention_dropout / hidden_dropout).")
    attention_dropout: float | None = Field(
        None, ge=0.0, lt=1.0, description="Dropout on the attention probabilities (null: model.dropout); "
        "HF: attention_probs_dropout_prob (BERT), attention_dropout (Llama-like), attn_pdrop (GPT-2).")
    hidden_dropout: float | None = Field(
        None, ge=0.0, lt=1.0, description="Dropout on the residual branches (attention and MLP outputs) and "
        "the embeddings (null: model.dropout); HF: hidden_dropout_prob (BERT), resid_pdrop and embd_pdrop "
        "(GPT-2).")
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
    norm_placement: Literal["pre", "post", "sandwich", "post_ln"] | None = Field(
        None, description="Where each block's norms sit: pre x + f(norm(x)) (Pre-LN: Llama, GPT-2); post "
        "x + norm(f(x)) (OLMo 2: norms on the sub-layers' outputs); sandwich x + norm(f(norm(x))) (Gemma "
        "2 / 3); post_ln norm(x + f(x)) (Post-LN, the norm after the residual add: the original "
        "Transformer, BERT). Unset: pre for the decoder, post_ln for the encoder. An encoder takes pre "
        "(then a final norm follows the last block) or post_ln."
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
        if isinstance(data, dict) and data.get("arch") == "t5":
            # the only position scheme T5 has, and T5 1.0's feed-forward, unless the config says otherwise
            data = {"pos_embedding": "relative", "mlp": "relu", **data}
        return data

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.norm_placement is None:
            # The family's own placement, resolved once so that every reader sees a value; set past the
            # frozen guard and out of model_fields_set (the user did not set it: init_from may differ).
            object.__setattr__(self, "norm_placement", "post_ln" if self.arch == "encoder" else "pre")
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
        if self.arch == "encoder" and self.block_position_embedding:
            raise ValueError("model.block_position_embedding (GLM's blank positions) is for decoders; "
                             "model.arch=encoder has none: set it to false")
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
        from lmforge.config.t5 import check_t5_fields

        check_t5_fields(self)
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
        gemma = dict(norm_placement=self.norm_placement in ("post", "sandwich"),
                     norm_weight_offset=self.norm_weight_offset,
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
    def resolved_attention_dropout(self) -> float:
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    @property
    def resolved_hidden_dropout(self) -> float:
        return self.dropout if self.hidden_dropout is None else self.hidden_dropout

    @property
    def any_dropout(self) -> bool:
        """Whether any dropout acts in training (attention, residual or embeddings)."""
        return self.resolved_attention_dropout > 0 or self.resolved_hidden_dropout > 0

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
