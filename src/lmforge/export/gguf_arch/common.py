"""What the GGUF family modules share: the writing context, a planned tensor, the metadata and tensor
plan of a Llama-shaped decoder (which most families extend), and the RoPE and context-length keys."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from lmforge.errors import LmforgeError


@dataclass
class Context:
    gguf: Any                    # the gguf module
    writer: Any                  # gguf.GGUFWriter
    cfg: dict[str, Any]          # the Hugging Face config.json
    arch: str                    # llama.cpp architecture name
    tensors: Any                 # export.gguf._Tensors: names, shapes, one tensor at a time
    say: Callable[..., None]
    extra: dict[str, Any] = field(default_factory=dict)  # what metadata() leaves for plan()

    @property
    def n_layers(self) -> int:
        return int(self.cfg["num_hidden_layers"])

    @property
    def n_heads(self) -> int:
        return int(self.cfg["num_attention_heads"])

    @property
    def n_kv(self) -> int:
        return int(self.cfg.get("num_key_value_heads") or self.n_heads)

    @property
    def head_dim(self) -> int:
        return int(self.cfg.get("head_dim") or self.cfg["hidden_size"] // self.n_heads)

    def names(self):
        """gguf-py's map from Hugging Face tensor names to llama.cpp's for this architecture."""
        enum = next(a for a, n in self.gguf.MODEL_ARCH_NAMES.items() if n == self.arch)
        return self.gguf.get_tensor_name_map(enum, self.n_layers)


@dataclass
class Planned:
    """One tensor of the file: its GGUF name and shape (Hugging Face order: out features first), a
    loader returning it (any float dtype; called once, when its bytes are written) and whether it may
    be quantized (False: kept F32, as llama.cpp keeps norms, biases and small side tensors). `role`
    overrides the quantization role kquants.role_of gives the name ('output', 'more_bits', 'plain', or
    'q8_0': kept at 8 bits under the 4-bit types, as llama.cpp keeps some tensors of some families)."""
    name: str
    shape: list[int]
    load: Callable[[], torch.Tensor]
    quantize: bool = True
    role: str | None = None


def llama_metadata(ctx: Context) -> None:
    """The keys of a Llama-shaped decoder: sizes, heads, RMSNorm eps, RoPE, context length."""
    w, cfg = ctx.writer, ctx.cfg
    w.add_context_length(context_length(cfg, ctx.say))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(ctx.n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(ctx.n_heads)
    w.add_head_count_kv(ctx.n_kv)
    w.add_key_length(ctx.head_dim)
    w.add_value_length(ctx.head_dim)
    w.add_rope_dimension_count(ctx.head_dim)
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    ctx.extra["rope_freqs"] = rope_keys(ctx)


def mapped(ctx: Context, transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
           skip: Callable[[str], bool] | None = None) -> Iterable[Planned]:
    """Every Hugging Face tensor under gguf-py's name for it (the LM head left out when tied), through
    `transform(hf_name, tensor)` if given; a `rope_freqs` tensor first when llama_metadata made one."""
    freqs = ctx.extra.get("rope_freqs")
    if freqs is not None:
        yield Planned("rope_freqs.weight", list(freqs.shape), lambda: freqs, quantize=False)
    names = ctx.names()
    for hf_name in ctx.tensors.where:
        if hf_name == "lm_head.weight" and ctx.cfg.get("tie_word_embeddings"):
            continue
        if skip is not None and skip(hf_name):
            continue
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise LmforgeError(f"GGUF export: no llama.cpp name for tensor {hf_name!r} of a {ctx.arch} model")
        load = (lambda n=hf_name: ctx.tensors[n]) if transform is None else (
            lambda n=hf_name: transform(n, ctx.tensors[n]))
        yield Planned(gname, ctx.tensors.shape(hf_name), load)


def rope_keys(ctx: Context) -> torch.Tensor | None:
    """Write the RoPE keys; returns the `rope_freqs` tensor llama.cpp takes Llama 3.1's scaling as (each
    frequency's divisor), or None."""
    from lmforge.models.hf import rope

    gguf, writer, cfg, arch, head_dim = ctx.gguf, ctx.writer, ctx.cfg, ctx.arch, ctx.head_dim
    params = rope.rope_params(cfg)
    kind = rope.rope_kind(params)
    theta = rope.rope_theta(cfg, params)
    writer.add_rope_freq_base(theta)
    if kind == "default":
        return None
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(params["factor"]))
        return None
    scaling, _ = rope.scaling_from_hf(params, int(cfg.get("max_position_embeddings", 2048)))
    if kind == "llama3" and arch == "llama":
        from types import SimpleNamespace

        from lmforge.models.common.rope import inv_frequencies

        # lmforge's own Llama 3.1 frequencies, as divisors of the plain ones: exactly what we compute
        original = scaling["original_max_position_embeddings"]
        ours = inv_frequencies(head_dim, theta, SimpleNamespace(**scaling), original)
        return inv_frequencies(head_dim, theta) / ours
    plain_yarn = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}
    if kind == "yarn" and all(scaling.get(k, v) == v for k, v in plain_yarn.items()) and not any(
            k in scaling for k in ("mscale", "mscale_all_dim", "attention_factor")):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        return None
    raise LmforgeError(f"GGUF export supports RoPE scaling none, linear, yarn (default betas, no mscale or "
                       f"attention_factor) and llama3 (Llama only); this {arch} model has {kind!r} {params}")


def context_length(cfg: dict[str, Any], say) -> int:
    """max_position_embeddings, capped at a sliding window: llama.cpp's llama/qwen2/qwen3 attend to the
    whole context, which equals sliding-window attention only while the context fits in the window."""
    ctx = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", cfg.get("model_type") == "mistral")
    if uses_window and window is not None and int(window) < ctx:
        say(f"note: the model attends over a sliding window of {window} tokens, which llama.cpp's "
            f"{cfg['model_type']} does not have; the GGUF's context length is set to {window} (not {ctx}), "
            "where both compute the same")
        return int(window)
    return ctx


def permute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Hugging Face's Llama rotates each head's two halves against each other; llama.cpp's `llama`
    architecture rotates adjacent pairs. Reorder a q/k projection's rows (out features, per head)
    from halves to pairs, so that the same rotation lands on the same numbers."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
