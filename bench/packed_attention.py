"""Attention over packed rows (several documents per row, block-diagonal causal): which kernel is fastest.

    python bench/packed_attention.py                    # on CUDA: ~1 minute on an H100
    python bench/packed_attention.py --json /tmp/packed_attention.json

Rows of --seq-len tokens are filled with documents whose lengths are drawn from a log-normal (median
seq_len / 6, sigma 0.9, capped at seq_len; the same mix as bench/sft_packing.py), the tail of each row
left as padding (its own segment, as lmforge's ChatLoader marks it with -1). One attention layer of a
Llama ~1.1B block (16 heads of 128), batch 4 x 2048, bf16, forward + backward. Candidates:

  sdpa-mask   F.scaled_dot_product_attention with the dense (B, 1, T, T) boolean mask (what lmforge
              uses on CPU; on CUDA the mask rules out the flash kernel)
  flex        torch.nn.attention.flex_attention (compiled) with a BlockMask from the segment ids
              (create_block_mask, compiled): fully masked 128 x 128 tiles are skipped
  varlen      torch.nn.attention.varlen.varlen_attn (FlashAttention-2 varlen): the B x T positions as one
              stream cut at every segment boundary (cu_seqlens), causal within each piece
  flex-traced the same with create_block_mask called inside the compiled function (as inside a
              compiled model); its build time is counted in its fwd+bwd
  causal      plain causal SDPA over the whole row (flash): NOT a correct packed attention (documents see
              each other), shown as the unpacked floor

Each candidate's time includes building its mask / block mask / cu_seqlens from the segment ids once per
step (reported alone too; a model builds it once and shares it between its layers), so the per-model
cost is build + n_layers x attention. Correctness: every correct candidate's output and input gradients
are compared with running each document alone through causal SDPA (fp32 math, the reference): max abs
difference printed, in bf16 and, for those that support it, in fp32 (must be ~1e-6).

Method: --warmup calls per candidate, then --rounds rounds of one call each, the order rotating;
median ms. Never asserts; prints machine info and a markdown table.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from machine import machine_info, print_markdown_table  # bench/machine.py (on sys.path)


def segments(B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """(B, T) int32 segment ids: documents from the log-normal length mix, -1 for the padded tail."""
    seg = torch.full((B, T), -1, dtype=torch.int32)
    nxt = 0
    for b in range(B):
        pos = 0
        while True:
            z = torch.randn((), generator=gen).item()
            n = max(4, min(T, int(math.exp(math.log(T / 6) + 0.9 * z))))
            if pos + n > T:
                break
            seg[b, pos : pos + n] = nxt
            nxt += 1
            pos += n
    return seg


def dense_mask(seg: torch.Tensor) -> torch.Tensor:
    T = seg.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=seg.device).tril()
    return (causal[None] & (seg[:, :, None] == seg[:, None, :]))[:, None]


def cu_seqlens(seg: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Boundaries of the flattened stream: a new piece at every row start and segment change."""
    B, T = seg.shape
    start = torch.ones_like(seg, dtype=torch.bool)
    start[:, 1:] = seg[:, 1:] != seg[:, :-1]
    idx = start.flatten().nonzero().flatten().to(torch.int32)
    cu = torch.cat([idx, torch.tensor([B * T], dtype=torch.int32, device=seg.device)])
    return cu, int((cu[1:] - cu[:-1]).max())


def reference(q, k, v, seg):
    """Each document (and each padding run) alone through causal SDPA, in fp32."""
    out = torch.zeros_like(q, dtype=torch.float32)
    B, T = seg.shape
    start = torch.ones_like(seg, dtype=torch.bool)
    start[:, 1:] = seg[:, 1:] != seg[:, :-1]
    for b in range(B):
        bounds = start[b].nonzero().flatten().tolist() + [T]
        for s, e in zip(bounds[:-1], bounds[1:]):
            out[b, :, s:e] = F.scaled_dot_product_attention(
                q[b : b + 1, :, s:e].float(),
                k[b : b + 1, :, s:e].float(),
                v[b : b + 1, :, s:e].float(),
                is_causal=True,
            )[0]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark compares CUDA kernels: run it on a machine with a GPU")
    dev = torch.device("cuda")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    try:
        from torch.nn.attention.varlen import varlen_attn

        varlen_sig = str(inspect.signature(varlen_attn))
    except ImportError:
        varlen_attn, varlen_sig = None, None
    flex = torch.compile(flex_attention, dynamic=False)
    B, T, H, D = args.batch, args.seq_len, args.heads, args.head_dim
    seg = segments(B, T, torch.Generator().manual_seed(0)).to(dev)
    n_docs = int((seg.max() + 1).item())
    pad = float((seg < 0).float().mean())

    def doc_causal(segs):
        def mask_mod(b, h, q_idx, kv_idx):
            return (segs[b, q_idx] == segs[b, kv_idx]) & (q_idx >= kv_idx)

        return mask_mod

    @torch.compile(dynamic=False)
    def flex_traced(q, k, v, s):
        # the block mask built inside the compiled region (as it would be inside a compiled model)
        bm = create_block_mask(doc_causal(s), B, None, T, T, device=dev)
        return flex_attention(q, k, v, block_mask=bm)

    def build(name, s):
        if name == "sdpa-mask":
            return dense_mask(s)
        if name == "flex":
            return create_block_mask(doc_causal(s), B, None, T, T, device=dev, _compile=True)
        if name == "varlen":
            return cu_seqlens(s)
        return None

    def varlen_call(q, k, v, built):
        cu, mx = built
        qf, kf, vf = (t.transpose(1, 2).reshape(B * T, H, D) for t in (q, k, v))
        if "window_size" in varlen_sig:
            o = varlen_attn(qf, kf, vf, cu, cu, mx, mx, window_size=(-1, 0))
        else:
            o = varlen_attn(qf, kf, vf, cu, cu, mx, mx, is_causal=True)
        return o.view(B, T, H, D).transpose(1, 2)

    def attend(name, q, k, v, built):
        if name == "sdpa-mask":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=built)
        if name == "flex":
            return flex(q, k, v, block_mask=built)
        if name == "varlen":
            return varlen_call(q, k, v, built)
        if name == "flex-traced":
            return flex_traced(q, k, v, seg)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    names = ["sdpa-mask", "flex", "flex-traced", "causal"] + (["varlen"] if varlen_attn is not None else [])
    gen = torch.Generator(device=dev).manual_seed(1)
    res = dict(
        shape=dict(B=B, T=T, H=H, D=D),
        docs=n_docs,
        pad_fraction=pad,
        varlen_signature=varlen_sig,
        candidates={},
    )

    # correctness against per-document SDPA
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (
            torch.randn(B, H, T, D, device=dev, dtype=dtype, generator=gen, requires_grad=True)
            for _ in range(3)
        )
        ref_in = [t.detach().clone().float().requires_grad_() for t in (q, k, v)]
        ref = reference(*ref_in, seg)
        g = torch.randn_like(ref)
        ref.backward(g)
        for name in names:
            if name == "causal" or (name == "varlen" and dtype == torch.float32):
                continue
            for t in (q, k, v):
                t.grad = None
            try:
                out = attend(name, q, k, v, build(name, seg))
                out.backward(g.to(dtype))
            except Exception as e:  # noqa: BLE001 - report and go on
                res["candidates"].setdefault(name, {})[f"error_{dtype}"] = repr(e)[:300]
                continue
            err = max(
                float((out.float() - ref).abs().max()),
                *(float((t.grad.float() - r.grad).abs().max()) for t, r in zip((q, k, v), ref_in)),
            )
            res["candidates"].setdefault(name, {})[f"max_err_{str(dtype).split('.')[-1]}"] = err

    q, k, v = (
        torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16, generator=gen, requires_grad=True)
        for _ in range(3)
    )
    go = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16, generator=gen)

    def step(name):
        built = build(name, seg)
        out = attend(name, q, k, v, built)
        out.backward(go)

    def build_only(name):
        build(name, seg)

    times = {n: [] for n in names}
    build_times = {n: [] for n in names}
    live = [n for n in names if "error_torch.bfloat16" not in res["candidates"].get(n, {})]
    for _ in range(args.warmup):
        for n in live:
            step(n)
            build_only(n)
    torch.cuda.synchronize()
    for r in range(args.rounds):
        order = live[r % len(live) :] + live[: r % len(live)]
        for n in order:
            for fn, store in ((step, times), (build_only, build_times)):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(n)
                torch.cuda.synchronize()
                store[n].append(time.perf_counter() - t0)
    rows = []
    for n in live:
        c = res["candidates"].setdefault(n, {})
        c["ms_fwd_bwd_with_build"] = 1e3 * statistics.median(times[n])
        c["ms_build"] = 1e3 * statistics.median(build_times[n])
        c["ms_16_layers"] = c["ms_build"] + 16 * (c["ms_fwd_bwd_with_build"] - c["ms_build"])
    base = res["candidates"]["sdpa-mask"]["ms_16_layers"]
    for n in live:
        c = res["candidates"][n]
        rows.append(
            [
                n,
                f"{c['ms_fwd_bwd_with_build']:.3f}",
                f"{c['ms_build']:.3f}",
                f"{c['ms_16_layers']:.2f}",
                f"{base / c['ms_16_layers']:.2f}x",
                f"{c.get('max_err_bfloat16', float('nan')):.2e}",
                f"{c.get('max_err_float32', float('nan')):.2e}",
            ]
        )
    info = machine_info(gpu=torch.cuda.get_device_name())
    print(f"machine: {info}")
    print(
        f"batch {B} x {T}, {H} heads x {D}, bf16; {n_docs} documents, padding {pad:.1%}; "
        f"varlen_attn{varlen_sig}"
    )
    print_markdown_table(
        [
            "kernel",
            "ms fwd+bwd (incl. build)",
            "ms build",
            "ms 16 layers",
            "vs sdpa-mask",
            "max err bf16",
            "max err fp32",
        ],
        rows,
    )
    for n, c in res["candidates"].items():
        for key, val in c.items():
            if key.startswith("error"):
                print(f"{n}: {key}: {val}")
    if args.json:
        args.json.write_text(
            json.dumps(dict(machine=info, command=" ".join(sys.argv), results=res), indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
