"""What a frozen base with low-rank adapters (finetune.method lora / qlora) saves for backward, block by
block; tools/estimate_parts.activation_profile uses it in place of `block_saved` for such a model.

A frozen weight needs no input for its own gradient, and an op none of whose inputs needs a gradient
saves nothing, so the rules differ from full training (checked against autograd's saved tensors in
tests/unit/test_estimate_methods.py), per token of a micro-batch, c = bytes of the compute dtype:

  the stream: the frozen embedding's output needs no gradient; it starts needing one at the first
      adapted layer (or at the embedding when finetune.train_tokens makes token rows train)
  norms: with a frozen weight, RMSNorm saves x and rstd (not x * rstd), LayerNorm x, mean and rstd, and
      only where their input needs a gradient
  a linear without an adapter saves nothing but its weight (autocast's cast copy of it: the weight
      copies row); an adapted one (LoRALinear, finetune/lora.py) saves its input and x A^T (r per
      token): in fp32 the input is the storage its neighbours save too (q/k/v share the norm's output;
      wo's input is the attention output); under autocast each fused layer casts it itself, the CPU's
      fused group (q/k/v, gate/up, all adapted) once for the group, and it also saves the stacked A
  QLoRA's NF4 base and adapter dropout take the plain path: the base saves only its packed codes, the
      adapter F.linear(dropout(x), A) saves its input (a dropout output and its mask per layer) and
      F.linear(., B) the r-wide product; under autocast each layer's cast copy of the input
  attention and the MLP save what they save in full training wherever their inputs need gradients
"""

from __future__ import annotations

from dataclasses import dataclass

from lmforge.config.schema import Config

QKV = ("attn.wq", "attn.wk", "attn.wv")
GATE_UP = ("mlp.w_gate", "mlp.w_up")
BLOCK_LINEARS = (*QKV, "attn.wo", *GATE_UP, "mlp.w_down")


@dataclass(frozen=True)
class Adapters:
    """The adapters of a frozen base as the activations see them."""

    r: int
    per_block: tuple[frozenset[str], ...]  # adapted linears of each block (names as in BLOCK_LINEARS)
    nf4: bool  # the base linears are NF4 (qlora): the plain adapter path
    dropout: float  # finetune.dropout: the plain adapter path, a dropout output and mask per layer
    token_rows: bool  # finetune.train_tokens: the token table takes gradients (the stream from the start)

    def fused(self, device_type: str) -> tuple[bool, bool]:
        """(fused functions, grouped on the CPU): LoRALinear's fused path needs a plain frozen base and
        no active dropout; project_group runs on the CPU only."""
        fused = not self.nf4 and self.dropout == 0
        return fused, fused and device_type == "cpu"


def _site(N: int, width: int, outs: list[int], adapted: list[bool], r: int, c: int, low: bool, fused: bool,
          grouped: bool, dropout: bool, input_saved: bool, input_low: bool, input_grad: bool
          ) -> tuple[int, int]:
    """(bytes saved, bytes of autocast weight copies kept) of one input site: linears of output widths
    `outs` on the same input x (N, width), `adapted` marking those with an adapter. input_saved: an op
    beside them saves x itself; input_low: x is already in the compute dtype (an autocast cast returns
    x itself); input_grad: x needs a gradient (a weight's copy is kept only for x's gradient, except by
    the fused functions, which keep all they were given)."""
    n = sum(adapted)
    copies = 0
    if low:  # 2-byte casts: the base weight, A (r, in), B (out, r)
        for out, on in zip(outs, adapted):
            if on and fused:
                copies += out * width + r * width + out * r
            elif on:
                copies += (r * width if input_grad else 0) + out * r  # the NF4 base keeps no copy
                copies += out * width if (input_grad and dropout) else 0  # a plain base beside dropout
            elif input_grad:
                copies += out * width
        copies *= 2
    if not n:
        return 0, copies
    total = n * N * r * c  # x A^T of each adapter
    group = fused and grouped and n == len(outs) and n > 1
    if group and not low:
        total += n * r * width * 4  # the stacked A (under autocast it is the A copies, counted there)
    if dropout and input_grad:
        total += n * N * width * 4  # each layer's dropout mask (fp32, as the adapter computes)
    if not fused and (low or dropout):
        kept, size = n, (c if low else 4)  # each layer's own cast (or dropout output)
    elif low and not input_low:
        kept, size = (1 if group else n), c  # a cast of the fp32 norm output per call
    else:
        kept, size = (0 if input_saved else 1), c  # x itself
    return total + kept * N * width * size, copies


def frozen_block_saved(cfg: Config, B: int, T: int, precision: str, device_type: str, adapters: Adapters,
                       block: int, grad_in: bool, mask_bytes: int) -> tuple[int, int, bool]:
    """(bytes block `block` saves for backward on micro-batch (B, T), bytes of the autocast weight
    copies it keeps, whether its output needs a gradient) for a frozen base with `adapters`; grad_in:
    whether its input needs one; mask_bytes: the attention mask a layer saves (estimate_parts)."""
    m = cfg.model
    low = precision in ("bf16", "fp16")
    c = 2 if low else 4
    N = B * T
    d, D, F = m.d_model, m.resolved_head_dim, m.resolved_d_ff
    h, hk = m.n_heads, m.resolved_kv_heads
    norm = (d + 1) * 4 if m.norm == "rmsnorm" else (d + 2) * 4
    fused, grouped = adapters.fused(device_type)
    drop = adapters.dropout > 0
    on = adapters.per_block[block]
    args = (adapters.r, c, low, fused, grouped, drop)
    total = N * norm if grad_in else 0
    # attention: q, k, v need gradients where the stream or their own adapter does
    qkv = [name in on for name in QKV]
    saved, copies = _site(N, d, [h * D, hk * D, hk * D], qkv, *args, False, False, grad_in)
    total += saved
    rq, rk, rv = (grad_in or a for a in qkv)
    attn = rq or rk or rv
    if attn:
        total += N * ((2 * h + 2 * hk) * D * c + h * 4) + mask_bytes
        if low and m.pos_embedding == "rope":
            total += (rq + rk) * 2 * T * D * c  # cos and sin cast for each rotated tensor
    wo = "attn.wo" in on
    saved, more = _site(N, h * D, [d], [wo], *args, attn, True, attn)
    total, copies = total + saved, copies + more
    grad = grad_in or attn or wo
    # the MLP
    total += N * norm if grad else 0
    if m.mlp == "swiglu":
        gu = [name in on for name in GATE_UP]
        saved, more = _site(N, d, [F, F], gu, *args, False, False, grad)
        rg, ru = grad or gu[0], grad or gu[1]
        total += saved + N * F * c * (rg + ru + rg)  # silu's input; the product's two factors
        inner = rg or ru
    else:
        up = "mlp.w_up" in on
        saved, more = _site(N, d, [F], [up], *args, False, False, grad)
        inner = grad or up
        total += saved + N * F * c * inner  # gelu's input
    copies += more
    down = "mlp.w_down" in on
    saved, more = _site(N, F, [d], [down], *args, False, True, inner)
    return total + saved, copies + more, grad or inner or down


def adapter_elements(cfg: Config, adapters: Adapters) -> list[tuple[str, tuple[int, int], int]]:
    """(name, shape, block) of every adapter parameter: lora_A (r, in) and lora_B (out, r)."""
    m = cfg.model
    d, D, F = m.d_model, m.resolved_head_dim, m.resolved_d_ff
    shapes = {"attn.wq": (d, m.n_heads * D), "attn.wk": (d, m.resolved_kv_heads * D),
              "attn.wv": (d, m.resolved_kv_heads * D), "attn.wo": (m.n_heads * D, d),
              "mlp.w_gate": (d, F), "mlp.w_up": (d, F), "mlp.w_down": (F, d)}
    out = []
    for i, on in enumerate(adapters.per_block):
        for name in BLOCK_LINEARS:
            if name in on:
                fan_in, fan_out = shapes[name]
                out.append((f"layers.{i}.{name}.lora_A", (adapters.r, fan_in), i))
                out.append((f"layers.{i}.{name}.lora_B", (fan_out, adapters.r), i))
    return out
