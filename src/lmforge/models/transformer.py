"""The decoder-only transformer. Llama, Qwen2, Mistral and GPT-2 style models differ by config flags only.

Parameter names are the checkpoint format (HF key maps build on them):

    tok_embeddings.weight, pos_embeddings.weight (learned positions only),
    layers.{i}.attn_norm, layers.{i}.attn.{wq,wk,wv,wo}, layers.{i}.mlp_norm,
    layers.{i}.mlp.{w_gate (swiglu only), w_up, w_down}, norm, output.weight (untied only)

With model.moe every block has `layers.{i}.moe` (models/moe.py) in place of `layers.{i}.mlp` (except the
first moe.dense_layers blocks). With model.mla, `layers.{i}.attn` is multi-head latent attention
(models/common/mla.py) with its own projections.

With tied embeddings there is no `output` module: the logits use `tok_embeddings.weight`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config.schema import ModelConfig
from lmforge.models.common.attention import Attention, KVCache, LayerKV, document_block_mask, packed_kernel
from lmforge.models.common.mla import MLA
from lmforge.models.common.mlp import MLP
from lmforge.models.common.norm import RMSNorm, build_norm
from lmforge.models.common.prefix_masks import check_prefix_inputs, prefix_mask
from lmforge.models.common.rope import (
    attention_factor,
    length_dependent_inv_frequencies,
    rope_angles,
    rope_tables,
)
from lmforge.models.moe import GroupedExperts, MoE, Router

# Residual-stream output projections get init_std / sqrt(2 * n_layers) (GPT-2 / nanoGPT), so the
# variance of the residual stream does not grow with depth at init.
_RESIDUAL_OUT = ("attn.wo", "mlp.w_down", "shared.w_down")


def _dropout(p: float) -> nn.Module:
    # Identity when off: F.dropout(p=0) in training mode still costs a pass over the activations.
    return nn.Dropout(p) if p > 0 else nn.Identity()


def _refill_buffers(module: Transformer, _incompatible_keys) -> None:
    # A module-level function, not a lambda, so that whole models still pickle (torch.save(model)).
    module.init_buffers()


class Block(nn.Module):
    """Transformer block, by `cfg.norm_placement`: pre x + attn(norm(x)), then x + mlp(norm(x));
    post x + norm(attn(x)) (OLMo 2); sandwich x + norm(attn(norm(x))) (Gemma); post_ln
    norm(x + attn(x)) (the original Transformer). The norms before the sub-layers are `attn_norm` /
    `mlp_norm` (identities under post; after the residual add under post_ln), those after
    `attn_post_norm` / `mlp_post_norm` (under post and sandwich only).

    Call as `block(x, rope, mask=None, kv=None)`:
      x     (B, T, d_model) hidden states;
      rope  (cos, sin), each (T, head_dim) or (B, T, head_dim) for the positions of x, or None with
            learned positions;
      mask  boolean (T, S) or (B, 1, T, S) attention mask (True = attend), or None for plain causal
            attention;
      kv    this layer's KVCache view `cache.layer(i)`, or None.
    Training only ever passes (x, rope) plus, with a sliding window, a mask: wrappers (activation
    checkpointing, FSDP, pipeline stages) can forward the arguments unchanged.
    """

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.index = index  # the layer's place in the model, for per-layer settings
        self.use_rope = index not in cfg.nope_layers
        self.residual_multiplier = cfg.residual_multiplier
        pre = cfg.norm_placement != "post"  # post_ln keeps these two, applied after the residual add
        self.post = cfg.norm_placement in ("post", "sandwich")
        self.post_ln = cfg.norm_placement == "post_ln"
        self.attn_norm = build_norm(cfg) if pre else nn.Identity()
        self.attn = Attention(cfg) if cfg.mla is None else MLA(cfg)
        self.mlp_norm = build_norm(cfg) if pre else nn.Identity()
        if self.post:
            self.attn_post_norm = build_norm(cfg)
            self.mlp_post_norm = build_norm(cfg)
        # models whose first blocks stay dense: moe.dense_layers
        self.is_moe = cfg.moe is not None and index >= cfg.moe.dense_layers
        if self.is_moe:
            self.moe = MoE(cfg)
        else:
            self.mlp = MLP(cfg)
        self.drop = _dropout(cfg.resolved_hidden_dropout)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None = None,
        kv: LayerKV | None = None,
    ) -> torch.Tensor:
        if self.post_ln:  # a Python constant
            return self._post_ln(x, rope, mask, kv)
        out = self.attn(self.attn_norm(x), rope if self.use_rope else None, mask, kv)  # (B, T, d_model)
        if self.post:  # a Python constant: no op when off
            out = self.attn_post_norm(out)
        if self.residual_multiplier != 1.0:  # a Python constant: no op when off
            out = out * self.residual_multiplier
        x = x + self.drop(out)
        ffn = self.moe if self.is_moe else self.mlp
        out = ffn(self.mlp_norm(x))
        if self.post:
            out = self.mlp_post_norm(out)
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        return x + self.drop(out)

    def _post_ln(self, x, rope, mask, kv) -> torch.Tensor:
        """Post-LN: x = norm(x + attn(x)), then x = norm(x + mlp(x)) (the original Transformer)."""
        out = self.attn(x, rope if self.use_rope else None, mask, kv)  # (B, T, d_model)
        x = self.attn_norm(x + self.drop(out * self.residual_multiplier))
        out = (self.moe if self.is_moe else self.mlp)(x)
        return self.mlp_norm(x + self.drop(out * self.residual_multiplier))


class Transformer(nn.Module):
    """Decoder-only language model: `model(input_ids (B, T)) -> logits (B, T, vocab)`.

    Optional: `cache` (KVCache, for generation), `attention_mask` (B, S) of 1/0 for padded batches,
    `position_ids` (B, T).

    Built on the current default device (the meta device inside `with torch.device("meta")`, where
    it stays uninitialised); elsewhere it is initialised with `init_weights()`. Construction itself
    draws no random numbers, so a direct build and `build_model` give the same weights for a seed.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.vocab_size is None:
            raise ValueError(
                "model.vocab_size is not set; set it in the config or derive it from the tokenizer "
                "before building the model"
            )
        super().__init__()
        self.cfg = cfg
        # How packed rows attend ("auto", "mask" or "flex"; see models/common/attention.py).
        self.packed_attention = "auto"
        target = torch.get_default_device()
        # Allocate on meta, then materialise: PyTorch's default inits would be wasted work (they
        # are overwritten by init_weights) and would consume the global RNG.
        with torch.device("meta"):
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
            if cfg.pos_embedding == "learned":
                self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.d_model)
            if cfg.block_position_embedding:  # GLM's intra-span positions (objective glm)
                self.block_pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.d_model)
            self.drop = _dropout(cfg.resolved_hidden_dropout)
            self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
            self.norm = build_norm(cfg)
            if not cfg.tie_embeddings:
                self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            if cfg.score_head:
                # a per-token head (tagger, span reader) has a bias, as transformers' do
                self.score = nn.Linear(cfg.d_model, cfg.num_labels, bias=cfg.score_reads != "sequence")
            if cfg.value_head:
                self.value = nn.Linear(cfg.d_model, 1, bias=False)
            if cfg.pos_embedding == "rope":
                # Non-persistent: derived from the config, never part of a checkpoint.
                shape = (cfg.max_seq_len, cfg.rotary_dim)
                self.register_buffer("rope_cos", torch.empty(shape, dtype=torch.float32), persistent=False)
                self.register_buffer("rope_sin", torch.empty(shape, dtype=torch.float32), persistent=False)
                if cfg.rope_local_theta is not None:  # Gemma 3: the sliding layers' own, unscaled base
                    self.register_buffer("rope_local_cos", torch.empty(shape, dtype=torch.float32),
                                         persistent=False)
                    self.register_buffer("rope_local_sin", torch.empty(shape, dtype=torch.float32),
                                         persistent=False)
        # Gemma scales embeddings by sqrt(d_model) rounded to float32 and then to the compute dtype,
        # as transformers' buffer is: one exact multiplier per dtype, looked up in forward.
        self._embed_scales = {
            dt: float(torch.tensor(cfg.d_model**0.5, dtype=torch.float32, device="cpu").to(dt))
            for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
        } if cfg.embed_scale else None
        # to_empty() leaves buffers uninitialised too; refilling them after every load_state_dict
        # makes "build on meta -> to_empty -> load a checkpoint" correct without an init_weights call.
        self.register_load_state_dict_post_hook(_refill_buffers)
        if target.type != "meta":
            self.to_empty(device=target)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Fresh initialisation by `cfg.init`, deterministic given torch's global seed.

        normal: linear weights and embeddings ~ N(0, init_std); attn.wo and mlp.w_down ~ N(0,
        init_std / sqrt(2 * n_layers)) (GPT-2: keeps the residual stream's variance from growing
        with depth). xavier: Glorot-uniform linear weights. kaiming: He-normal (fan_in, ReLU gain).
        small_init (Nguyen & Salazar 2019; GPT-NeoX): hidden weights N(0, sqrt(2 / (5 d))),
        residual outputs N(0, 2 / (n_layers sqrt(d))), embeddings and output head N(0, 1e-4).
        Biases 0; norm weights 1 (LayerNorm bias 0). Also refills RoPE tables.
        """
        cfg = self.cfg
        std = cfg.init_std
        out_std = std / math.sqrt(2 * cfg.n_layers)
        if cfg.init == "small_init":
            std = math.sqrt(2.0 / (5.0 * cfg.d_model))
            out_std = 2.0 / (cfg.n_layers * math.sqrt(cfg.d_model))
        edge_std = 1e-4 if cfg.init == "small_init" else cfg.init_std  # embeddings, output head
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                if name in ("output", "score", "value"):
                    nn.init.normal_(m.weight, mean=0.0, std=edge_std)
                elif cfg.init == "xavier":
                    nn.init.xavier_uniform_(m.weight)
                elif cfg.init == "kaiming":
                    nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
                else:
                    nn.init.normal_(m.weight, mean=0.0, std=out_std if name.endswith(_RESIDUAL_OUT) else std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=edge_std)
            elif isinstance(m, Attention) and m.sinks is not None:
                nn.init.zeros_(m.sinks)  # a sink logit of 0: weight exp(0) beside the keys' at the start
            elif isinstance(m, GroupedExperts):
                m.init_weights(cfg.init, std, out_std)
            elif isinstance(m, Router) and m.expert_bias is not None:
                m.expert_bias.zero_()
            elif isinstance(m, (RMSNorm, nn.LayerNorm)):
                m.reset_parameters()
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute the non-persistent RoPE cos/sin tables on the buffers' device."""
        if self.cfg.pos_embedding != "rope" or self.rope_cos.is_meta:
            return
        cfg = self.cfg
        cos, sin = rope_tables(
            cfg.rotary_dim, cfg.max_seq_len, cfg.rope_theta, self.rope_cos.device,
            scaling=cfg.rope_scaling, original=self._rope_original(),
        )
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        if cfg.rope_local_theta is not None:
            cos, sin = rope_tables(cfg.resolved_head_dim, cfg.max_seq_len, cfg.rope_local_theta,
                                   self.rope_local_cos.device)
            self.rope_local_cos.copy_(cos)
            self.rope_local_sin.copy_(sin)

    def _rope_original(self) -> int:
        """The context length RoPE scaling is relative to (config value, else max_seq_len)."""
        scaling = self.cfg.rope_scaling
        if scaling is None or scaling.original_max_position_embeddings is None:
            return self.cfg.max_seq_len
        return scaling.original_max_position_embeddings

    def _rope(
        self, start: int, end: int, position_ids: torch.Tensor | None, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for this forward: (T, head_dim) each, or (B, T, head_dim) with position_ids."""
        scaling = self.cfg.rope_scaling
        original = self._rope_original()
        device = self.rope_cos.device
        inv_freq = length_dependent_inv_frequencies(
            self.cfg.rotary_dim, self.cfg.rope_theta, scaling, original, seq_len, device
        )
        if inv_freq is not None:
            # Dynamic NTK (the base grows with the longest position of this forward) or longrope (the
            # long factors, past the original length), for all positions of the forward; keys already
            # in a KV cache keep the frequencies they were rotated with. This is what transformers
            # does during generation; unlike it, we keep no state (its dynamic NTK reuses the largest
            # base seen until a forward falls back below the original length).
            pos = position_ids if position_ids is not None else torch.arange(start, end, device=device)
            if position_ids is None or not torch.compiler.is_compiling():
                return rope_angles(pos, inv_freq, attention_factor(scaling, original))
            # Compiled, seq_len is the row length (reading the positions would sync the host), but the
            # scaling follows the largest position, as in transformers (packed rows of short documents
            # keep the original frequencies): compute and select inside the graph.
            seq = position_ids.max() + 1  # 0-d
            inv_freq = length_dependent_inv_frequencies(
                self.cfg.rotary_dim, self.cfg.rope_theta, scaling, original, seq, device
            )
            cos, sin = rope_angles(pos, inv_freq, attention_factor(scaling, original))
            is_long = seq > original
            return (torch.where(is_long, cos, self.rope_cos[position_ids]),
                    torch.where(is_long, sin, self.rope_sin[position_ids]))
        if position_ids is None:
            return self.rope_cos[start:end], self.rope_sin[start:end]  # each (T, head_dim)
        return self.rope_cos[position_ids], self.rope_sin[position_ids]  # each (B, T, head_dim)

    def _local_rope(self, start: int, end: int, position_ids: torch.Tensor | None):
        """(cos, sin) of the sliding layers' own base (rope_local_theta), shaped as `_rope`'s."""
        if position_ids is None:
            return self.rope_local_cos[start:end], self.rope_local_sin[start:end]
        return self.rope_local_cos[position_ids], self.rope_local_sin[position_ids]

    def _layer_inputs(self, start, T, device, attention_mask, segment_ids, rope, end, position_ids):
        """{layer kind: (rope, mask)} for models with per-layer attention kinds (cfg.layer_types): each
        kind's mask is built once per forward; sliding layers take rope_local_theta's tables if set."""
        cfg, out = self.cfg, {}
        for kind in set(cfg.layer_types):
            sliding = kind == "sliding_attention"
            window = cfg.sliding_window if sliding else None
            local = sliding and cfg.rope_local_theta is not None
            kind_rope = self._local_rope(start, end, position_ids) if local else rope
            out[kind] = (kind_rope, self._mask(start, T, device, attention_mask, segment_ids, window))
        return out

    def _packed_kernel(self, device: torch.device) -> str:
        if self.cfg.attn_logit_softcap is not None:
            return "mask"  # soft-capped scores run the explicit attention, which takes a dense mask
        dropout = self.cfg.resolved_attention_dropout if self.training else 0.0
        if self.cfg.attn_sinks:
            return "mask"  # flex attention has no sink logit: sink_attention takes the dense mask
        return packed_kernel(self.packed_attention, device, dropout, self.cfg.resolved_head_dim)

    def _mask(
        self, start: int, T: int, device: torch.device, attention_mask: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None, window: int | None = None,
    ):
        """Boolean (T, start + T) or, with padding or segments, (B, 1, T, start + T) mask; None where
        SDPA's is_causal (or no mask) is exact; for segments with the flex kernel, a BlockMask.
        window: the sliding window of the layers it is for (None: they see every earlier key)."""
        window_binds = window is not None and start + T > window
        if attention_mask is None and segment_ids is None and not window_binds and (start == 0 or T == 1):
            return None
        q_pos = torch.arange(start, start + T, device=device)[:, None]  # (T, 1)
        k_pos = torch.arange(start + T, device=device)[None, :]  # (1, S)
        mask = k_pos <= q_pos
        if window_binds:
            # Mistral: query i sees keys j with i - window < j <= i.
            mask &= k_pos > q_pos - window
        if segment_ids is not None and self._packed_kernel(device) == "flex":
            return document_block_mask(segment_ids, window if window_binds else None)
        if segment_ids is not None:
            # Packed rows: a query sees the keys of its own segment only (block-diagonal causal).
            same = segment_ids[:, :, None] == segment_ids[:, None, :]  # (B, T, T)
            return (mask[None] & same)[:, None]  # (B, 1, T, T)
        if attention_mask is None:
            return mask  # (T, S)
        # Padding keys are never attended. A query with no real key left (a pad before the first
        # real token) would get an all-False row, for which some SDPA kernels return NaN (older
        # PyTorch, some CUDA backends; torch 2.13 on CPU returns 0), and NaN values poison real rows
        # of later layers (zero weight times NaN is NaN): let every query see its own key. Pad
        # outputs are garbage either way; real queries already see themselves.
        mask = (mask[None] & attention_mask[:, None, :].bool()) | (k_pos == q_pos)  # (B, T, S)
        return mask[:, None]  # (B, 1, T, S)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        head: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
        segment_ids: torch.Tensor | None = None,
        prefix_end: torch.Tensor | None = None,
        block_position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, vocab_size) in the model's dtype.

        Positions are 0..T-1, or cache.pos..cache.pos+T-1 with a cache (whose pos then advances),
        unless `position_ids` (B, T) gives them (as transformers' generate does for left padding:
        cumsum(attention_mask) - 1).
        attention_mask: (B, S) of 1 (real token) / 0 (padding) over every key position, S = T without
        a cache and cache.pos + T with one, as in transformers. Padding keys are never attended; the
        logits at padding positions are meaningless (but finite).
        segment_ids: (B, T) ints, for rows that pack several sequences: a position attends only to
        earlier positions with the same id (pass position_ids restarting per sequence with it). Not
        with a cache or an attention_mask.
        prefix_end: (B, T) ints, with segment_ids: each segment attends both ways over its positions
        before prefix_end and causally after (prefix LM, GLM; models/common/prefix_masks.py).
        block_position_ids: (B, T) GLM's second positions (model.block_position_embedding; None: all 0).
        head: replaces the output projection: called as head(hidden (B, T, d_model) after the final
        norm, output weight (vocab_size, d_model)) and its result returned instead of the logits, so a
        loss can consume the projection chunk by chunk without the whole logits tensor existing.

        A pipeline stage is this module with parts removed (`lmforge.parallel` builds them, keeping
        parameter names): given hidden states (B, T, d_model), a float tensor, instead of token ids
        it skips the embeddings; without `norm` it returns the hidden states after its blocks.
        """
        B, T = input_ids.shape[:2]
        start = 0 if cache is None else cache.pos
        end = start + T
        seq_len = self._check_inputs(B, T, start, end, cache, attention_mask, position_ids, head)
        if input_ids.is_floating_point():
            x = input_ids  # (B, T, d_model): the previous pipeline stage's output
        else:
            x = self._embed(input_ids, start, end, position_ids, block_position_ids)  # (B, T, d_model)
        rope = None
        if self.cfg.pos_embedding == "rope":
            rope = self._rope(start, end, position_ids, seq_len)
        if segment_ids is not None and (cache is not None or attention_mask is not None
                                        or tuple(segment_ids.shape) != (B, T)):
            raise ValueError(f"segment_ids must be (batch, positions) = {(B, T)}, without a cache or an "
                             "attention_mask")
        kinds = self.cfg.layer_types
        if prefix_end is not None:
            check_prefix_inputs(B, T, segment_ids, prefix_end, cache, attention_mask, self.cfg)
            mask = prefix_mask(segment_ids, prefix_end, self._packed_kernel(input_ids.device))
        elif kinds is None:
            window = self.cfg.sliding_window
            mask = self._mask(start, T, input_ids.device, attention_mask, segment_ids, window)
        else:
            per_kind = self._layer_inputs(start, T, input_ids.device, attention_mask, segment_ids, rope, end,
                                          position_ids)
        # named_children: a pipeline stage holds its blocks in a ModuleDict keyed by layer index.
        for name, layer in self.layers.named_children():
            if kinds is not None:
                rope, mask = per_kind[kinds[int(name)]]
            x = layer(x, rope, mask, None if cache is None else cache.layer(int(name)))
        if self.norm is None:
            return x  # (B, T, d_model): a pipeline stage before the last
        return self._logits(self.norm(x), head, cache, end)

    def _check_inputs(
        self, B: int, T: int, start: int, end: int, cache: KVCache | None,
        attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, head: Callable | None,
    ) -> int:
        """Refuse inputs the forward cannot honour (naming the limit and the fix); return seq_len, the
        longest position + 1 that RoPE scaling sees (`end` unless position_ids says otherwise)."""
        if end > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {end} positions exceeds model.max_seq_len={self.cfg.max_seq_len}; "
                "shorten the input or raise model.max_seq_len"
            )
        if cache is not None and (end > cache.max_len or B != cache.batch_size):
            raise ValueError(
                f"input (batch {B}, positions {start}..{end - 1}) does not fit the KVCache "
                f"(batch {cache.batch_size}, max_len {cache.max_len})"
            )
        if head is not None and self.cfg.final_logit_softcap is not None:
            raise ValueError(
                f"model.final_logit_softcap={self.cfg.final_logit_softcap} soft-caps the logits, which a "
                "loss that takes the output projection itself (head=: train.loss_chunk_tokens, the RL "
                "objectives) would skip; set train.loss_chunk_tokens=0, or train with another objective"
            )
        if attention_mask is not None and tuple(attention_mask.shape) != (B, end):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}; expected (batch, key positions) "
                f"= {(B, end)}"
            )
        seq_len = end
        if position_ids is not None:
            if position_ids.shape[-1] != T or position_ids.dim() != 2:
                raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}; expected {(B, T)}")
            # Checking the values reads them on the host: a sync per forward, and a graph break under
            # torch.compile, where the caller (the fine-tuning loader) guarantees them instead.
            compiling = torch.compiler.is_compiling()
            seq_len = end if compiling else int(position_ids.max()) + 1
            if not compiling and (seq_len > self.cfg.max_seq_len or int(position_ids.min()) < 0):
                raise ValueError(
                    f"position_ids must lie in [0, model.max_seq_len={self.cfg.max_seq_len}), "
                    f"got up to {seq_len - 1}"
                )
        return seq_len

    def _embed(
        self, input_ids: torch.Tensor, start: int, end: int, position_ids: torch.Tensor | None,
        block_position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (B, T) -> the first block's input (B, T, d_model): embeddings, their scales, learned
        positions, dropout."""
        x = self.tok_embeddings(input_ids)  # (B, T, d_model)
        if self._embed_scales is not None:
            x = x * self._embed_scales[x.dtype]
        if self.cfg.embedding_multiplier != 1.0:
            x = x * self.cfg.embedding_multiplier
        if self.cfg.pos_embedding == "learned":
            if position_ids is None:
                x = x + self.pos_embeddings.weight[start:end]  # (T, d_model) broadcast over B
            else:
                x = x + self.pos_embeddings(position_ids)  # (B, T, d_model)
        if block_position_ids is not None and not self.cfg.block_position_embedding:
            raise ValueError("block_position_ids needs model.block_position_embedding=true")
        if self.cfg.block_position_embedding:  # ordinary text is block position 0, as GLM's part A
            x = x + (self.block_pos_embeddings.weight[0] if block_position_ids is None
                     else self.block_pos_embeddings(block_position_ids))
        return self.drop(x)

    def _logits(
        self, x: torch.Tensor, head: Callable | None, cache: KVCache | None, end: int
    ) -> torch.Tensor:
        """Final-normed hidden states (B, T, d_model) -> logits (B, T, vocab_size), scaled and soft-capped
        (or `head`'s result); a cache's pos advances to `end` only once the logits exist."""
        scaling = self.cfg.logits_scaling
        if head is not None:
            weight = self.tok_embeddings.weight if self.cfg.tie_embeddings else self.output.weight
            # The weight, not the hidden states, carries the scaling: a head that reads the hidden
            # states (a reward model's score) sees them as they are.
            return head(x, weight if scaling == 1.0 else weight / scaling)
        # Calling `output` (not F.linear on its weight) lets tensor parallelism hook the head.
        logits = F.linear(x, self.tok_embeddings.weight) if self.cfg.tie_embeddings else self.output(x)
        if scaling != 1.0:
            logits = logits / scaling
        cap = self.cfg.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if cache is not None:
            cache.pos = end
        return logits

def build_model(cfg: ModelConfig, device: torch.device | str | None = None) -> Transformer:
    """Build on the meta device, then materialise on `device` (default CPU) and init_weights().

    device="meta" returns the uninitialised meta model (to count or shard a large model without memory).
    With cfg.quant the chosen linear layers are QuantLinear (models/quant.py), empty until a quantized
    checkpoint is loaded into them. model.arch=encoder builds the masked-LM Encoder (models/encoder.py),
    model.arch=t5 the encoder-decoder (models/t5.py).
    """
    with torch.device("meta"):
        if cfg.arch == "encoder":
            from lmforge.models.encoder import Encoder

            model = Encoder(cfg)
        elif cfg.arch == "t5":
            from lmforge.models.t5 import T5

            model = T5(cfg)
        else:
            model = Transformer(cfg)
        if cfg.quant is not None:
            from lmforge.models.quant import apply_quant_layout

            apply_quant_layout(model, cfg.quant)
    device = torch.device(device or "cpu")
    if device.type != "meta":
        model.to_empty(device=device)
        model.init_weights()
    return model


def add_head(model: Transformer, name: str, std: float | None = None, outputs: int = 1,
             reads: str = "sequence") -> nn.Linear:
    """Give `model` (built without it) the scalar head `name`: "score" (a reward model's) or "value"
    (PPO's critic), N(0, std) (default model.init_std, as transformers initialises a
    sequence-classification head), on the model's device and dtype; `model.cfg.<name>_head` becomes
    True so its config rebuilds it. `outputs`: a classifier's score head has one per label (the
    config's num_labels); `reads` (model.score_reads): token or span heads have a bias (zero at first)."""
    if name not in ("score", "value") or (name == "value" and (outputs != 1 or reads != "sequence")):
        raise ValueError(f"unknown head {name!r} of {outputs} outputs: score, or value of 1")
    if model.cfg.arch == "encoder" and name == "score":  # BERT's pooler + classifier
        from lmforge.models.encoder import add_classifier

        return add_classifier(model, outputs, reads)
    ref = model.tok_embeddings.weight
    head = nn.Linear(model.cfg.d_model, outputs, bias=reads != "sequence", device=ref.device, dtype=ref.dtype)
    nn.init.normal_(head.weight, mean=0.0, std=model.cfg.init_std if std is None else std)
    if head.bias is not None:
        nn.init.zeros_(head.bias)
    setattr(model, name, head)
    labels = {"num_labels": outputs, "score_reads": reads} if name == "score" else {}
    model.cfg = model.cfg.model_copy(update={f"{name}_head": True, **labels})
    return head
