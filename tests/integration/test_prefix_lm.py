"""Objective prefix_lm: per-document boundaries and targets of a packed window against a hand-built
example, the attention mask (dense and flex) against a hand-built one, the loss against a brute-force
reference (an explicit per-query loop over a naive attention), seeded boundaries, a crashed run resuming
bit for bit, and the refusals (pipeline parallelism, encoders, sliding windows) as exit status 2."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from conftest import Crash, CrashAt, tiny_overrides
from lmforge.assembly.checks import check_layout
from lmforge.config import load_config
from lmforge.config.model import ModelConfig
from lmforge.data.batch import IGNORE_INDEX, TokenBatch
from lmforge.engine.objectives import build_objective
from lmforge.engine.objectives.prefix_lm import PrefixLM
from lmforge.errors import ConfigError
from lmforge.eval.open_run import evaluate
from lmforge.metrics.loggers import read_metrics
from lmforge.models.common import attention as attention_module
from lmforge.models.common.prefix_masks import prefix_block_mask, prefix_dense_mask
from lmforge.models.common.rope import apply_rope
from lmforge.models.transformer import build_model
from lmforge.parallel.dims import ParallelDims
from lmforge.train.trainer import Trainer, train

TINY = "configs/debug/tiny.yaml"
EOS = 0
I = IGNORE_INDEX  # noqa: E741
# A window of the stream: document A [5 6 7 EOS], document B [8 9 EOS], and the start of document C [4]
IDS = torch.tensor([[5, 6, 7, 0, 8, 9, 0, 4]])
NEXT = torch.tensor([[6, 7, 0, 8, 9, 0, 4, 3]])
# Query rows, key columns: A's prefix is 2 positions, B's 2, C's 1 (half of each, rounded to even).
HAND_MASK = ["11000000", "11000000", "11100000", "11110000", "00001100", "00001100", "00001110", "00000001"]


def _half() -> PrefixLM:
    return PrefixLM(0.5, 0.5, seed=0).bind(EOS)


def test_boundaries_positions_and_targets_equal_the_hand_built_ones():
    b = _half().batch_of(TokenBatch(IDS, NEXT))
    assert b.segment_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 2]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert b.prefix_end.tolist() == [[2, 2, 2, 2, 6, 6, 6, 8]]
    # the last prefix position predicts the first continuation token; an EOS's target (the next
    # document's first token) and the prefix's own tokens carry no loss
    assert b.targets.tolist() == [[I, 7, 0, I, I, 0, I, 3]]
    assert b.target_count() == 4 and b.num_tokens == 8


def test_dense_and_flex_masks_equal_the_hand_built_one():
    b = _half().batch_of(TokenBatch(IDS, NEXT))
    want = torch.tensor([[c == "1" for c in row] for row in HAND_MASK])
    dense = prefix_dense_mask(b.segment_ids, b.prefix_end)
    assert dense.shape == (1, 1, 8, 8) and torch.equal(dense[0, 0], want)
    # the BlockMask, through flex attention (CPU reference kernel), equals SDPA under the hand-built mask
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    block = prefix_block_mask(b.segment_ids, b.prefix_end)
    out = attention_module.flex(q, k, v, block, enable_gqa=False)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=want)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)


def _naive_forward(model, ids: torch.Tensor, docs: list[list[tuple[int, int, int]]]) -> torch.Tensor:
    """The model's logits with every attention replaced by an explicit loop over queries: query q of a
    document (start, length, prefix) sees keys k of that document with k <= q or k < start + prefix,
    rotated by positions counted from the document's start."""
    B, T = ids.shape
    pos = torch.zeros(B, T, dtype=torch.long)
    for b, row in enumerate(docs):
        for start, length, _ in row:
            pos[b, start : start + length] = torch.arange(length)
    cos, sin = model.rope_cos[pos], model.rope_sin[pos]

    def naive(self, x, rope, mask=None, kv=None):
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q = apply_rope(self.wq(x).view(B, T, H, D), cos, sin)
        k = apply_rope(self.wk(x).view(B, T, Hkv, D), cos, sin)
        v = self.wv(x).view(B, T, Hkv, D)
        out = torch.zeros(B, T, H, D)
        for b, row in enumerate(docs):
            for start, length, prefix in row:
                for i in range(start, start + length):
                    keys = [j for j in range(start, start + length) if j <= i or j < start + prefix]
                    for h in range(H):
                        kh = h // (H // Hkv)
                        scores = torch.stack([q[b, i, h] @ k[b, j, kh] for j in keys]) / math.sqrt(D)
                        w = torch.softmax(scores, 0)
                        out[b, i, h] = sum(w[n] * v[b, j, kh] for n, j in enumerate(keys))
        return self.wo(out.reshape(B, T, H * D))

    orig = attention_module.Attention.forward
    attention_module.Attention.forward = naive
    try:
        return model(ids)
    finally:
        attention_module.Attention.forward = orig


def test_loss_equals_a_brute_force_reference():
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=24, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                    max_seq_len=32, init_std=0.3)).eval()
    ids = torch.randint(1, 24, (2, 21))
    ids[0, [3, 9, 10, 16]] = EOS  # documents of 4, 6, 1, 6 positions and a cut one
    ids[1, [12]] = EOS
    nxt = torch.randint(1, 24, (2, 21))
    nxt[:, :-1] = ids[:, 1:]
    obj = PrefixLM(0.0, 1.0, seed=3).bind(EOS)
    batch = obj.batch_of(TokenBatch(ids, nxt))
    docs, want_targets = [], torch.full_like(ids, I)
    for b in range(2):
        row, start = [], 0
        for t in range(21):
            if ids[b, t] == EOS or t == 20:
                length = t - start + 1
                prefix = int(batch.prefix_end[b, start]) - start
                assert 1 <= prefix <= max(1, length - 1)
                row.append((start, length, prefix))
                for q in range(start + prefix - 1, t + 1):
                    if ids[b, q] != EOS:
                        want_targets[b, q] = nxt[b, q]
                start = t + 1
        docs.append(row)
    assert torch.equal(batch.targets, want_targets)
    with torch.no_grad():
        logits = _naive_forward(model, ids, docs)
        ref = sum(-torch.log_softmax(logits[b, q], -1)[want_targets[b, q]]
                  for b in range(2) for q in range(21) if want_targets[b, q] != I)
        loss = obj(model, batch).loss
    n = batch.target_count()
    assert n > 10
    torch.testing.assert_close(loss / n, ref / n, atol=1e-6, rtol=0)


def test_boundaries_are_seeded_by_content():
    ids = torch.randint(1, 50, (4, 40), generator=torch.Generator().manual_seed(1))
    ids[:, 17] = EOS
    nxt = torch.roll(ids, -1, 1)
    a, b = PrefixLM(seed=5).bind(EOS), PrefixLM(seed=5).bind(EOS)
    one = a.batch_of(TokenBatch(ids, nxt))
    assert torch.equal(one.prefix_end, b.batch_of(TokenBatch(ids, nxt)).prefix_end)
    # a row's boundaries do not depend on its neighbours (micro-batch splits, world sizes)
    assert torch.equal(one.prefix_end[2:], a.batch_of(TokenBatch(ids[2:], nxt[2:])).prefix_end)
    other = PrefixLM(seed=6).bind(EOS).batch_of(TokenBatch(ids, nxt))
    assert not torch.equal(one.prefix_end, other.prefix_end)
    assert len(set(one.prefix_end[:, 0].tolist())) > 1  # rows get different boundaries


def test_crashed_prefix_lm_run_resumes_bit_for_bit(tmp_path, shared_data_dir):
    extra = ("objective.name=prefix_lm", "train.max_steps=8", "checkpoint.every=4", "train.eval_every=4",
             "train.log_every=1")
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    train(load_config(TINY, tiny_overrides(straight, shared_data_dir, *extra)))
    with pytest.raises(Crash):
        cfg = load_config(TINY, tiny_overrides(crashed, shared_data_dir, *extra))
        Trainer(cfg, callbacks=[CrashAt(6)]).fit()
    train(load_config(TINY, tiny_overrides(crashed, shared_data_dir, *extra)), resume=True)
    a, b = (list(read_metrics(d / "metrics.jsonl")) for d in (straight, crashed))
    keys = ("step", "loss", "grad_norm", "val_loss")
    a, b = ([{k: r[k] for k in keys if k in r} for r in rows] for rows in (a, b))
    assert len([r for r in a if "loss" in r]) == 8 and [r for r in a if "val_loss" in r]
    assert a == b
    # `lmforge eval` of the run: the same objective (its boundaries come from the data alone)
    report = evaluate(straight, ["eval.max_batches=2"])
    assert math.isfinite(report["loss"]) and report["ppl"] == pytest.approx(math.exp(report["loss"]))


@pytest.mark.parametrize("cfg", [dict(arch="encoder", pos_embedding="learned", tie_embeddings=True),
                                 dict(sliding_window=8)])
def test_models_the_mask_cannot_go_through_are_refused(cfg):
    model = build_model(ModelConfig(vocab_size=24, d_model=32, n_layers=1, n_heads=2, max_seq_len=32, **cfg))
    with pytest.raises(ConfigError, match="objective prefix_lm"):
        PrefixLM().bind(EOS).check_model(model)


def test_pipeline_parallelism_is_refused_before_any_step(tiny_cfg):
    cfg = tiny_cfg("objective.name=prefix_lm", "parallel.pp=2", "parallel.dp_shard=1")
    dims = ParallelDims.resolve(cfg.parallel, 2, grad_accum_steps=2)
    with pytest.raises(ConfigError, match="objective prefix_lm has no per-stage loss"):
        check_layout(cfg, dims, build_objective(cfg), custom_model=False)


@pytest.mark.parametrize("setting, message", [
    ("model.arch=encoder model.pos_embedding=learned model.tie_embeddings=true",
     "objective.name=prefix_lm does not fit model.arch=encoder"),
    ("prefix_lm.min_fraction=0.8", "prefix_lm.min_fraction=0.8 exceeds prefix_lm.max_fraction=0.5"),
])
def test_cli_refusals_exit_2(tmp_path, setting, message):
    args = [sys.executable, "-m", "lmforge", "train", "-c", TINY]
    for s in ("objective.name=prefix_lm", "prefix_lm.max_fraction=0.5", f"run.dir={tmp_path / 'run'}",
              f"data.dir={tmp_path / 'data'}", *setting.split()):
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and message in out.stderr
    assert not (tmp_path / "run").exists()


def test_the_forward_refuses_a_prefix_it_cannot_honour():
    model = build_model(ModelConfig(vocab_size=24, d_model=32, n_layers=1, n_heads=2, max_seq_len=32))
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="prefix_end needs segment_ids"):
        model(ids, prefix_end=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="block_position_embedding=true"):
        model(ids, block_position_ids=torch.zeros(1, 4, dtype=torch.long))


def test_loss_chunk_tokens_is_honoured():
    """train.loss_chunk_tokens: the same loss with the output projection taken a chunk at a time."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=24, d_model=32, n_layers=1, n_heads=2, max_seq_len=32))
    ids = torch.randint(1, 24, (2, 20))
    ids[0, 7] = EOS
    whole, chunked = PrefixLM(seed=1).bind(EOS), PrefixLM(seed=1, chunk_tokens=8).bind(EOS)
    batch = whole.batch_of(TokenBatch(ids, torch.roll(ids, -1, 1)))
    with torch.no_grad():
        torch.testing.assert_close(chunked(model, batch).loss, whole(model, batch).loss, atol=1e-4, rtol=1e-6)
