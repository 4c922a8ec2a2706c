"""The encoder-decoder of T5 (`model.arch: t5`): T5 1.0 (ReLU feed-forward, head tied to the embedding with
the d_model**-0.5 rescale of the decoder output) and v1.1 / Flan-T5 (gated-GELU, untied head, no rescale)
differ by config flags only (`mlp`, `tie_embeddings`, `scale_decoder_output`).

Against our decoder: no absolute positions, a learned bias per head and relative-position bucket added to
the attention scores instead (computed by the first block of each stack and shared by all of its blocks,
bidirectional in the encoder, backwards only in the decoder), unscaled dot products, RMS norms without
bias before each sublayer plus one after each stack, no biases at all, and a decoder block that attends
to the encoder output between its self-attention and its feed-forward. Parameter names (the checkpoint
format; models/hf/t5.py maps them to transformers'):

    tok_embeddings.weight, output.weight (untied), {encoder,decoder}.rel_bias.weight,
    {encoder,decoder}.layers.{i}.attn.{wq,wk,wv,wo}, .attn_norm, .mlp.{w_gate,w_up,w_down}, .mlp_norm,
    decoder.layers.{i}.cross.{wq,wk,wv,wo}, decoder.layers.{i}.cross_norm, {encoder,decoder}.norm
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config.schema import ModelConfig
from lmforge.models.common.norm import RMSNorm


def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


def relative_bucket(rel: torch.Tensor, bidirectional: bool, num_buckets: int,
                    max_distance: int) -> torch.Tensor:
    """T5's bucket of each relative position `rel` = key - query (Mesh TensorFlow's rule, as transformers
    computes it): half the buckets exact distances, the rest logarithmically wider up to max_distance;
    bidirectional splits the buckets between keys after and before the query, else keys after it all
    fall into bucket 0 (the causal mask hides them)."""
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).long() * num_buckets
        rel = rel.abs()
    else:
        rel = -torch.min(rel, torch.zeros_like(rel))
    exact = num_buckets // 2
    small = rel < exact
    large = exact + (torch.log(rel.float() / exact) / math.log(max_distance / exact)
                     * (num_buckets - exact)).long()
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(small, rel, large)


class RelativeBias(nn.Module):
    """The learned bias per (bucket, head): `bias(q_len, k_len, offset)` -> (1, H, q_len, k_len), queries at
    positions offset.. offset+q_len-1 (a decoder step after `offset` cached tokens), keys at 0..k_len-1."""

    def __init__(self, cfg: ModelConfig, bidirectional: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.relative_attention_num_buckets, cfg.n_heads))
        self.bidirectional = bidirectional
        self.num_buckets = cfg.relative_attention_num_buckets
        self.max_distance = cfg.relative_attention_max_distance

    def forward(self, q_len: int, k_len: int, offset: int = 0) -> torch.Tensor:
        dev = self.weight.device
        q = torch.arange(q_len, dtype=torch.long, device=dev)[:, None] + offset
        k = torch.arange(k_len, dtype=torch.long, device=dev)[None, :]
        idx = relative_bucket(k - q, self.bidirectional, self.num_buckets, self.max_distance)  # (q, k)
        return F.embedding(idx, self.weight).permute(2, 0, 1).unsqueeze(0)  # (1, H, q, k)


class T5Attention(nn.Module):
    """Multi-head attention without bias or 1/sqrt(d) scale; `bias` (1|B, H, Tq, Tk) carries the positions
    and the mask. `attn(x, bias, kv=None)`: self-attention over x, or attention to `kv` (B, S, d_model);
    `kv_cache`: (k, v) already projected, (B, H, S, D) each (the cross-attention of a generation step)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.resolved_head_dim
        inner = self.n_heads * self.head_dim
        self.wq = nn.Linear(cfg.d_model, inner, bias=False)
        self.wk = nn.Linear(cfg.d_model, inner, bias=False)
        self.wv = nn.Linear(cfg.d_model, inner, bias=False)
        self.wo = nn.Linear(inner, cfg.d_model, bias=False)
        self.p_drop = cfg.resolved_attention_dropout

    def heads(self, x: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
        B, T, _ = x.shape
        return proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heads(x, self.wk), self.heads(x, self.wv)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        B, H, T, D = q.shape
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=1.0,
                                             dropout_p=self.p_drop if self.training else 0.0)  # (B, H, T, D)
        return self.wo(out.transpose(1, 2).reshape(B, T, H * D))

    def forward(self, x: torch.Tensor, bias: torch.Tensor, kv: torch.Tensor | None = None) -> torch.Tensor:
        k, v = self.project_kv(x if kv is None else kv)
        return self.attend(self.heads(x, self.wq), k, v, bias)


class T5FeedForward(nn.Module):
    """relu: w_down(relu(w_up x)) (T5 1.0's wi, wo); geglu: w_down(gelu_tanh(w_gate x) * w_up x) (v1.1's
    gated-gelu: wi_0, wi_1, wo); dropout after the activation, as T5 has it."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, ff = cfg.d_model, cfg.resolved_d_ff
        self.gated = cfg.mlp == "geglu"
        if self.gated:
            self.w_gate = nn.Linear(d, ff, bias=False)
        self.w_up = nn.Linear(d, ff, bias=False)
        self.w_down = nn.Linear(ff, d, bias=False)
        self.drop = _dropout(cfg.resolved_hidden_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            h = F.gelu(self.w_gate(x), approximate="tanh") * self.w_up(x)  # (B, T, d_ff)
        else:
            h = F.relu(self.w_up(x))
        return self.w_down(self.drop(h))


class T5Block(nn.Module):
    """Pre-norm block: x + attn(norm(x)), [x + cross(norm(x), enc)], x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, cross: bool) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = T5Attention(cfg)
        if cross:
            self.cross_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
            self.cross = T5Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = T5FeedForward(cfg)
        self.drop = _dropout(cfg.resolved_hidden_dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, enc: torch.Tensor | None = None,
                enc_bias: torch.Tensor | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        h = self.attn_norm(x)
        if cache is None:
            x = x + self.drop(self.attn(h, bias))
        else:  # a generation step: this step's keys and values join the cached ones
            k, v = self.attn.project_kv(h)
            cache.k = k if cache.k is None else torch.cat([cache.k, k], dim=2)  # (B, H, S, D)
            cache.v = v if cache.v is None else torch.cat([cache.v, v], dim=2)
            x = x + self.drop(self.attn.attend(self.attn.heads(h, self.attn.wq), cache.k, cache.v, bias))
        if enc is not None or (cache is not None and cache.cross is not None):
            h = self.cross_norm(x)
            if cache is None:
                x = x + self.drop(self.cross(h, enc_bias, enc))
            else:  # the encoder output's keys and values are projected once per generation
                if cache.cross is None:
                    cache.cross = self.cross.project_kv(enc)
                q = self.cross.heads(h, self.cross.wq)
                x = x + self.drop(self.cross.attend(q, *cache.cross, enc_bias))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


@dataclass
class LayerCache:
    """One decoder block's cache: its self-attention keys/values so far and the encoder's, projected."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    cross: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class DecoderCache:
    """The decoder's state during generation: the encoder output and its key mask, one LayerCache per
    block, and the number of decoder positions already processed."""

    enc: torch.Tensor
    enc_keep: torch.Tensor | None
    layers: list[LayerCache] = field(default_factory=list)
    pos: int = 0


class T5Stack(nn.Module):
    """n blocks sharing one relative bias, then a final norm; `cross` makes them decoder blocks."""

    def __init__(self, cfg: ModelConfig, n: int, decoder: bool) -> None:
        super().__init__()
        self.decoder = decoder
        self.rel_bias = RelativeBias(cfg, bidirectional=not decoder)
        self.layers = nn.ModuleList(T5Block(cfg, cross=decoder) for _ in range(n))
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.drop = _dropout(cfg.resolved_hidden_dropout)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None, enc: torch.Tensor | None = None,
                enc_keep: torch.Tensor | None = None, cache: DecoderCache | None = None) -> torch.Tensor:
        """x (B, T, d_model) embedded; keep (B, Tk) bool of the keys a query may see (None: all)."""
        T = x.size(1)
        offset = 0 if cache is None else cache.pos
        bias = self.rel_bias(T, offset + T, offset)  # (1, H, T, offset + T)
        if self.decoder:
            q = torch.arange(T, device=x.device)[:, None] + offset
            causal = torch.arange(offset + T, device=x.device)[None, :] <= q  # (T, offset + T)
            bias = _masked(bias, causal[None, None])
        if keep is not None:
            bias = _masked(bias, keep[:, None, None, :])
        enc_bias = None
        if self.decoder:
            enc_len = (enc if cache is None else cache.enc).size(1)
            enc_bias = torch.zeros(1, 1, 1, enc_len, dtype=x.dtype, device=x.device)
            keys = enc_keep if cache is None else cache.enc_keep
            if keys is not None:
                enc_bias = _masked(enc_bias, keys[:, None, None, :])
        x = self.drop(x)
        for i, layer in enumerate(self.layers):
            lc = None if cache is None else cache.layers[i]
            x = layer(x, bias, enc if cache is None else cache.enc, enc_bias, lc)
        return self.drop(self.norm(x))


def _masked(bias: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """bias with the scores of hidden keys at the dtype's lowest value (transformers' additive mask: a row
    with every key hidden then averages them instead of giving NaN)."""
    return bias.masked_fill(~keep, torch.finfo(bias.dtype).min)


def _keep(mask: torch.Tensor | None, shape: tuple[int, int], what: str) -> torch.Tensor | None:
    if mask is None:
        return None
    if tuple(mask.shape) != shape:
        raise ValueError(f"{what} has shape {tuple(mask.shape)}; expected {shape}")
    return mask.bool()


class T5(nn.Module):
    """`model(input_ids (B, S), decoder_input_ids (B, T)) -> logits (B, T, vocab)`.

    `attention_mask` (B, S) of 1/0: padding of the encoder input, never attended by either stack. The
    decoder is causal; its inputs start with `decoder_start_token_id` (teacher forcing: the targets shifted
    right). `encode` and `decode` run the two halves (generation encodes once, models/t5_generate.py).

    Built like the Transformer: on the current default device, initialised unless that is meta;
    construction draws no random numbers.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.vocab_size is None:
            raise ValueError("model.vocab_size is not set; set it in the config or derive it from the "
                             "tokenizer before building the model")
        assert cfg.arch == "t5"
        super().__init__()
        self.cfg = cfg
        target = torch.get_default_device()
        with torch.device("meta"):
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.encoder = T5Stack(cfg, cfg.n_layers, decoder=False)
            self.decoder = T5Stack(cfg, cfg.n_decoder_layers or cfg.n_layers, decoder=True)
            if not cfg.tie_embeddings:
                self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if target.type != "meta":
            self.to_empty(device=target)
            self.init_weights()

    @property
    def scale_output(self) -> bool:
        s = self.cfg.scale_decoder_output
        return self.cfg.tie_embeddings if s is None else s

    @torch.no_grad()
    def init_weights(self) -> None:
        """T5's init (transformers' with initializer_factor 1): embeddings and an untied head N(0, 1), each
        projection N(0, fan_in**-0.5) (queries (d_model * head_dim)**-0.5: the scale T5 leaves out of the
        dot product), relative biases N(0, d_model**-0.5), norms 1."""
        d = self.cfg.d_model
        nn.init.normal_(self.tok_embeddings.weight, std=1.0)
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.output.weight, std=1.0)
        for m in self.modules():
            if isinstance(m, T5Attention):
                nn.init.normal_(m.wq.weight, std=(d * m.head_dim) ** -0.5)
                for w in (m.wk, m.wv):
                    nn.init.normal_(w.weight, std=d ** -0.5)
                nn.init.normal_(m.wo.weight, std=(m.n_heads * m.head_dim) ** -0.5)
            elif isinstance(m, T5FeedForward):
                for w in ([m.w_gate, m.w_up] if m.gated else [m.w_up]):
                    nn.init.normal_(w.weight, std=d ** -0.5)
                nn.init.normal_(m.w_down.weight, std=m.w_down.in_features ** -0.5)
            elif isinstance(m, RelativeBias):
                nn.init.normal_(m.weight, std=d ** -0.5)
            elif isinstance(m, RMSNorm):
                m.reset_parameters()

    def init_buffers(self) -> None:
        """No derived buffers (relative positions are computed per call)."""

    def _check_len(self, n: int, what: str) -> None:
        if n > self.cfg.max_seq_len:
            raise ValueError(f"{what} of {n} positions exceeds model.max_seq_len={self.cfg.max_seq_len}; "
                             "shorten it or raise model.max_seq_len")

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B, S) -> the encoder output (B, S, d_model)."""
        B, S = input_ids.shape
        self._check_len(S, "the encoder input")
        keep = _keep(attention_mask, (B, S), "attention_mask")
        return self.encoder(self.tok_embeddings(input_ids), keep)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Decoder output (..., d_model) -> logits (..., vocab)."""
        if self.scale_output:
            h = h * self.cfg.d_model ** -0.5
        return F.linear(h, self.tok_embeddings.weight if self.cfg.tie_embeddings else self.output.weight)

    def decode(self, decoder_input_ids: torch.Tensor, enc: torch.Tensor,
               attention_mask: torch.Tensor | None = None, cache: DecoderCache | None = None) -> torch.Tensor:
        """decoder_input_ids (B, T) attending to enc (B, S, d_model) -> logits (B, T, vocab); with `cache`
        (generation) the T new positions follow cache.pos cached ones, and enc / attention_mask are the
        cache's."""
        B, T = decoder_input_ids.shape
        self._check_len(T + (cache.pos if cache is not None else 0), "the decoder input")
        keep = None if cache is not None else _keep(attention_mask, (B, enc.size(1)), "attention_mask")
        x = self.tok_embeddings(decoder_input_ids)  # (B, T, d_model)
        h = self.decoder(x, None, enc, keep, cache)
        if cache is not None:
            cache.pos += T
        return self.head(h)

    def new_cache(self, enc: torch.Tensor, attention_mask: torch.Tensor | None = None) -> DecoderCache:
        """An empty decoder cache over the encoder output `enc` (B, S, d_model)."""
        keep = _keep(attention_mask, tuple(enc.shape[:2]), "attention_mask")
        return DecoderCache(enc=enc, enc_keep=keep, layers=[LayerCache() for _ in self.decoder.layers])

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        enc = self.encode(input_ids, attention_mask)
        return self.decode(decoder_input_ids, enc, attention_mask)
