"""Named model sizes. A preset fills the `model` section; keys given explicitly next to it win.

The shapes follow published models where one exists (GPT-2 small/medium, Llama 2/3), so that
parameter counts and FLOPs can be checked against the papers.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # Tests and smoke runs: a few thousand parameters per layer.
    "debug": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128),
    # The CPU demo size: trains in minutes on two cores.
    "10m": dict(d_model=256, n_layers=6, n_heads=8, n_kv_heads=4, max_seq_len=512),
    # GPT-2 small / medium shapes with the Llama block (RMSNorm, RoPE, SwiGLU).
    "125m": dict(d_model=768, n_layers=12, n_heads=12, d_ff=2048, max_seq_len=2048),
    "350m": dict(d_model=1024, n_layers=24, n_heads=16, d_ff=2816, max_seq_len=2048),
    # Llama-3.2-1B-like and Llama-2-7B shapes (build on the meta device to count without memory).
    "1b": dict(
        d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192, max_seq_len=4096,
        rope_theta=500000.0,
    ),
    "7b": dict(
        d_model=4096, n_layers=32, n_heads=32, d_ff=11008, max_seq_len=4096, tie_embeddings=False,
        vocab_size=32000,
    ),
}
