"""The bidirectional encoder of masked language modelling: BERT and RoBERTa differ by config flags only
(`model.arch: encoder`; `type_vocab_size`, `position_offset`, `norm_eps`).

Against our decoder it attends both ways (a padding mask, no causal one), uses Post-LN blocks (or Pre-LN
with `norm_placement: pre`, plus `final_norm`: not a BERT checkpoint then, so no HF export), sums
word, learned position and token-type embeddings into an embedding LayerNorm, and predicts through an
MLM head (dense + activation + LayerNorm, then the tied embedding with a bias of its own). Attention
and MLP are the decoder's modules, so the parameter names below are the checkpoint format (the HF key
maps in models/hf/bert.py build on them):

    tok_embeddings.weight, pos_embeddings.weight, type_embeddings.weight (type_vocab_size > 0),
    emb_norm, layers.{i}.attn.{wq,wk,wv,wo}, layers.{i}.attn_norm, layers.{i}.mlp.{w_up,w_down},
    layers.{i}.mlp_norm, head.dense, head.norm, head.bias
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config.schema import ModelConfig
from lmforge.models.common.attention import Attention
from lmforge.models.common.mlp import MLP
from lmforge.models.common.norm import RMSNorm, build_norm


def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


class EncoderBlock(nn.Module):
    """Post-LN block (BERT, `norm_placement: post_ln`): x = norm(x + attn(x)), then x = norm(x + mlp(x));
    Pre-LN (`pre`): x = x + attn(norm(x)), then x = x + mlp(norm(x)) (the encoder then ends in
    `final_norm`). The same two norms, `attn_norm` and `mlp_norm`, either way.

    `block(x, mask)`: x (B, T, d_model); mask boolean (B, 1, 1, T) True = attend, or None (every key).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.pre = cfg.norm_placement == "pre"
        self.attn = Attention(cfg)
        self.attn_norm = build_norm(cfg)
        self.mlp = MLP(cfg)
        self.mlp_norm = build_norm(cfg)
        self.drop = _dropout(cfg.resolved_hidden_dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.pre:  # a Python constant
            x = x + self.drop(self.attn(self.attn_norm(x), None, mask))  # (B, T, d_model)
            return x + self.drop(self.mlp(self.mlp_norm(x)))
        x = self.attn_norm(x + self.drop(self.attn(x, None, mask)))  # (B, T, d_model)
        return self.mlp_norm(x + self.drop(self.mlp(x)))


class MLMHead(nn.Module):
    """dense -> activation (the MLP's) -> LayerNorm, then the tied embedding plus `bias` (vocab,)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.d_model, bias=True)
        self.norm = build_norm(cfg)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.approximate = "tanh" if cfg.mlp == "gelu_tanh" else "none"

    def forward(self, h: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        h = self.norm(F.gelu(self.dense(h), approximate=self.approximate))  # (..., d_model)
        return F.linear(h, embedding, self.bias)  # (..., vocab)


class Encoder(nn.Module):
    """Masked-LM encoder: `model(input_ids (B, T)) -> logits (B, T, vocab)`.

    Optional: `attention_mask` (B, T) of 1/0 (padding keys are never attended), `token_type_ids`
    (B, T) (default 0), `position_ids` (B, T), and `select` (B, T) bool: then only the logits of the
    selected positions are computed and returned, (N, vocab) in row-major order (masked LM predicts
    ~15% of the positions: the vocabulary projection of the others is wasted work).

    Built like the Transformer: on the current default device, initialised unless that is meta;
    construction draws no random numbers.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.vocab_size is None:
            raise ValueError("model.vocab_size is not set; set it in the config or derive it from the "
                             "tokenizer before building the model")
        assert cfg.arch == "encoder" and cfg.pos_embedding == "learned" and cfg.tie_embeddings
        super().__init__()
        self.cfg = cfg
        target = torch.get_default_device()
        with torch.device("meta"):
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
            # RoBERTa keeps rows 0..offset-1 for padding: the table has offset more rows.
            self.pos_embeddings = nn.Embedding(cfg.max_seq_len + cfg.position_offset, cfg.d_model)
            if cfg.type_vocab_size:
                self.type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.d_model)
            self.emb_norm = build_norm(cfg)
            self.drop = _dropout(cfg.resolved_hidden_dropout)
            self.layers = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.n_layers))
            if cfg.norm_placement == "pre":  # Pre-LN leaves the residual stream unnormalised
                self.final_norm = build_norm(cfg)
            if cfg.score_head:  # a classifier (BERT's pooler and classifier) instead of the MLM head
                if cfg.score_reads == "sequence":  # a per-token head reads no pooled [CLS]
                    self.pooler = nn.Linear(cfg.d_model, cfg.d_model, bias=True)
                self.score = nn.Linear(cfg.d_model, cfg.num_labels, bias=True)
            else:
                self.head = MLMHead(cfg)
        if target.type != "meta":
            self.to_empty(device=target)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """BERT's init: linear weights and embeddings ~ N(0, init_std), biases 0, norms 1 / 0."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=self.cfg.init_std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.LayerNorm, RMSNorm)):
                m.reset_parameters()
        if not self.cfg.score_head:
            nn.init.zeros_(self.head.bias)

    def init_buffers(self) -> None:
        """No derived buffers (the decoder's RoPE tables have no counterpart here)."""

    def positions(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the position table: 0..T-1 (BERT); with an offset (RoBERTa, offset = padding_idx + 1)
        the tokens that are not padding count offset, offset+1, ... and padding sits at row offset-1,
        derived from the ids as transformers does (whatever the attention mask says)."""
        off = self.cfg.position_offset
        if off == 0:
            return torch.arange(input_ids.size(1), device=input_ids.device)[None]  # (1, T)
        real = (input_ids != off - 1).long()  # (B, T)
        return torch.cumsum(real, dim=1) * real + (off - 1)  # (B, T)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        select: torch.Tensor | None = None,
        head=None,
    ) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, vocab), or (N, vocab) for the N positions `select` picks;
        `head(hidden, None)` instead of the MLM head when given (a classifier reads the hidden states)."""
        B, T = input_ids.shape
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {T} positions exceeds model.max_seq_len={self.cfg.max_seq_len}; "
                             "shorten the input or raise model.max_seq_len")
        if attention_mask is not None and tuple(attention_mask.shape) != (B, T):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected {(B, T)}")
        if position_ids is None:
            position_ids = self.positions(input_ids)
        x = self.tok_embeddings(input_ids) + self.pos_embeddings(position_ids)  # (B, T, d_model)
        if self.cfg.type_vocab_size:
            types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            x = x + self.type_embeddings(types)
        x = self.drop(self.emb_norm(x))
        mask = None
        if attention_mask is not None:
            keep = attention_mask.bool()  # (B, T)
            # A row of padding only would leave its queries no key (NaN in some SDPA kernels): such a
            # row attends everywhere, as transformers' additive mask makes it do.
            keep = keep | ~keep.any(dim=1, keepdim=True)
            mask = keep[:, None, None, :]  # (B, 1, 1, T)
        for layer in self.layers:
            x = layer(x, mask)
        if self.cfg.norm_placement == "pre":
            x = self.final_norm(x)
        if select is not None:
            x = x[select]  # (N, d_model)
        if head is not None:
            return head(x, None)
        return self.head(x, self.tok_embeddings.weight)


def add_classifier(model: Encoder, outputs: int, reads: str = "sequence") -> nn.Linear:
    """Turn a masked-LM encoder into a sequence classifier: BERT's pooler (dense + tanh on [CLS]) and a
    classifier of `outputs` with biases, initialised as BERT initialises them (N(0, init_std), biases 0),
    in place of the MLM head, which classification never reads (BertForSequenceClassification has none);
    `model.cfg` gets score_head and num_labels so that its config rebuilds it. `reads` token or span
    (model.score_reads): a per-token classifier without the pooler (BertForTokenClassification's,
    BertForQuestionAnswering's)."""
    ref = model.tok_embeddings.weight
    d = model.cfg.d_model
    layers = []
    if reads == "sequence":
        model.pooler = nn.Linear(d, d, bias=True, device=ref.device, dtype=ref.dtype)
        layers.append(model.pooler)
    model.score = nn.Linear(d, outputs, bias=True, device=ref.device, dtype=ref.dtype)
    for layer in (*layers, model.score):
        nn.init.normal_(layer.weight, mean=0.0, std=model.cfg.init_std)
        nn.init.zeros_(layer.bias)
    if hasattr(model, "head"):
        del model.head
    model.cfg = model.cfg.model_copy(update={"score_head": True, "num_labels": outputs, "score_reads": reads})
    return model.score
