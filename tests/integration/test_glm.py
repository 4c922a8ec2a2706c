"""Objective glm (GLM's autoregressive blank infilling): a document's parts A and B, targets, 2-D
positions and attention mask against hand-built ones, seeded spans that reproduce (and cover about
mask_prob of the tokens with Poisson lengths), the loss against a brute-force reference, and a tiny run
end to end (prepare adds the tokens, training, resume of the same blanks, export refused)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from conftest import tiny_overrides
from lmforge.config import load_config
from lmforge.config.infill import GLM_TOKENS
from lmforge.config.model import ModelConfig
from lmforge.data import Tokenizer
from lmforge.data.batch import IGNORE_INDEX, TokenBatch
from lmforge.engine.objectives.glm import GLM, build_document, sample_spans
from lmforge.errors import ConfigError
from lmforge.metrics.loggers import read_metrics
from lmforge.models.common import attention as attention_module
from lmforge.models.common.prefix_masks import prefix_dense_mask
from lmforge.models.common.rope import apply_rope
from lmforge.models.transformer import build_model
from lmforge.train.trainer import train

TINY = "configs/debug/tiny.yaml"
EOS, MASK, START, END = 0, 90, 91, 92
IDS = {"mask": MASK, "start": START, "end": END}
I = IGNORE_INDEX  # noqa: E741


def _glm(seed: int = 0, **kw) -> GLM:
    return GLM(seed=seed, **kw).bind_tokens(EOS, MASK, START, END)


def test_parts_targets_and_2d_positions_equal_the_hand_built_ones():
    # x1..x6 = 11..16 and EOS; blanks x3 (at 2, length 1) and x5 x6 (at 4, length 2); B order: 2nd, 1st
    doc = [11, 12, 13, 14, 15, 16, 0]
    inputs, targets, pos, block, a = build_document(doc, [(2, 1), (4, 2)], [1, 0], IDS)
    assert a == 6
    assert inputs == [11, 12, MASK, 14, MASK, 0, START, 15, 16, START, 13]
    assert targets == [I, I, I, I, I, I, 15, 16, END, 13, END]
    assert pos == [0, 1, 2, 3, 4, 5, 4, 4, 4, 2, 2]  # a blank's tokens sit at its [MASK]'s position
    assert block == [0, 0, 0, 0, 0, 0, 1, 2, 3, 1, 2]  # and count from 1 inside it


def test_packed_row_and_mask_equal_the_hand_built_ones():
    # T = 12 leaves S = 12 - 2K = 8 source tokens (K = 2 blanks): a 3-token document and a cut 5-token one
    obj = _glm(mask_prob=0.2)
    assert obj.blanks(12) == 2
    ids = torch.tensor([[21, 22, 0, 31, 32, 33, 34, 35, 99, 99, 99, 99]])
    b = obj.batch_of(TokenBatch(ids, ids))
    # doc 0 (2 maskable tokens) gets round(0.4) = 0 blanks; doc 1 (5 tokens) round(1.0) = 1 of length 1
    inp = b.input_ids[0].tolist()
    assert inp[:3] == [21, 22, 0] and inp.count(MASK) == 1 and inp.count(START) == 1
    m = inp.index(MASK)
    hidden = ids[0, m].item()  # the token the blank hides
    assert inp[3:8] == [31, 32, 33, 34, 35][: m - 3] + [MASK] + [31, 32, 33, 34, 35][m - 2 :]
    assert inp[8:10] == [START, hidden] and b.targets[0].tolist() == [I] * 8 + [hidden, END, I, I]
    assert b.segment_ids[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, -1, -1]
    assert b.position_ids[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, m - 3, m - 3, 0, 0]
    assert b.block_position_ids[0].tolist() == [0] * 8 + [1, 2, 0, 0]
    want = ["111000000000", "111000000000", "111000000000",  # doc 0: all part A
            "000111110000", "000111110000", "000111110000", "000111110000", "000111110000",  # doc 1's A
            "000111111000", "000111111100",  # doc 1's B: A + causal over B
            "000000000010", "000000000001"]  # padding sees itself only
    mask = prefix_dense_mask(b.segment_ids, b.prefix_end)[0, 0]
    assert mask.tolist() == [[c == "1" for c in row] for row in want]
    assert b.target_count() == 2 and b.num_tokens == 10


def test_seeded_spans_reproduce_and_follow_glm_statistics():
    ids = torch.randint(1, 80, (16, 256), generator=torch.Generator().manual_seed(0))
    one = _glm(seed=4).batch_of(TokenBatch(ids, ids))
    again = _glm(seed=4).batch_of(TokenBatch(ids, ids))
    for name in ("input_ids", "targets", "position_ids", "block_position_ids", "prefix_end"):
        assert torch.equal(getattr(one, name), getattr(again, name)), name
    part = _glm(seed=4).batch_of(TokenBatch(ids[5:7], ids[5:7]))
    assert torch.equal(part.input_ids, one.input_ids[5:7])  # a row's blanks ignore its neighbours
    assert not torch.equal(one.input_ids, _glm(seed=5).batch_of(TokenBatch(ids, ids)).input_ids)
    # the spans: lengths max(1, Poisson(3)) (the last one of a document cut to the target), 15% covered
    g = torch.Generator().manual_seed(0)
    spans = [sample_spans(1000, 0.15, 3.0, 1000, g) for _ in range(20)]
    assert all(sum(n for _, n in s) == 150 for s in spans)
    lengths = [n for s in spans for _, n in s[:-1]]
    assert 3.0 < sum(lengths) / len(lengths) < 3.4  # E[max(1, Poisson(3))] = 3 + e^-3 = 3.05
    for s in spans:  # sorted, apart: no two blanks touch
        assert all(a + n < b for (a, n), (b, _) in zip(s, s[1:], strict=False))


def test_loss_equals_a_brute_force_reference():
    torch.manual_seed(0)
    # init_std 0.3: peaked attention, so that a wrong mask or position moves the loss well past 1e-6
    model = build_model(ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                    init_std=0.3, max_seq_len=64, block_position_embedding=True)).eval()
    with torch.no_grad():
        model.block_pos_embeddings.weight.normal_(0, 0.5)  # make the second positions matter
    ids = torch.randint(1, 80, (2, 48), generator=torch.Generator().manual_seed(1))
    ids[0, 20] = EOS
    obj = _glm(seed=2)
    batch = obj.batch_of(TokenBatch(ids, ids))
    B, T = batch.input_ids.shape
    seg, end = batch.segment_ids.tolist(), batch.prefix_end.tolist()
    cos, sin = model.rope_cos[batch.position_ids], model.rope_sin[batch.position_ids]

    def naive(self, x, rope, mask=None, kv=None):
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q = apply_rope(self.wq(x).view(B, T, H, D), cos, sin)
        k = apply_rope(self.wk(x).view(B, T, Hkv, D), cos, sin)
        v = self.wv(x).view(B, T, Hkv, D)
        out = torch.zeros(B, T, H, D)
        for b in range(B):
            for i in range(T):
                # part A of the document both ways, part B causally; padding sees itself
                keys = [j for j in range(T)
                        if seg[b][j] == seg[b][i] >= 0 and (j <= i or j < end[b][i])] or [i]
                for h in range(H):
                    kh = h // (H // Hkv)
                    w = torch.softmax(torch.stack([q[b, i, h] @ k[b, j, kh] for j in keys]) / math.sqrt(D), 0)
                    out[b, i, h] = sum(w[n] * v[b, j, kh] for n, j in enumerate(keys))
        return self.wo(out.reshape(B, T, H * D))

    orig = attention_module.Attention.forward
    attention_module.Attention.forward = naive
    try:
        with torch.no_grad():
            logits = model(batch.input_ids, block_position_ids=batch.block_position_ids)
    finally:
        attention_module.Attention.forward = orig
    ref = sum(-torch.log_softmax(logits[b, i], -1)[batch.targets[b, i]]
              for b in range(B) for i in range(T) if batch.targets[b, i] != I)
    with torch.no_grad():
        loss = obj(model, batch).loss
    n = batch.target_count()
    assert n >= 6
    torch.testing.assert_close(loss / n, ref / n, atol=1e-6, rtol=0)


def test_a_model_without_block_positions_is_refused():
    model = build_model(ModelConfig(vocab_size=96, d_model=32, n_layers=1, n_heads=2, max_seq_len=32))
    with pytest.raises(ConfigError, match="model.block_position_embedding=true"):
        _glm().check_model(model)
    with pytest.raises(ValueError, match="block_position_embedding"):
        ModelConfig(arch="encoder", pos_embedding="learned", tie_embeddings=True,
                    block_position_embedding=True)


def test_tiny_glm_run_prepares_its_tokens_trains_resumes_and_refuses_export(tmp_path):
    extra = ("objective.name=glm", "model.block_position_embedding=true", "train.max_steps=6",
             "checkpoint.every=3", "train.eval_every=3", "train.log_every=1", "data.max_chars=200000",
             "data.tokenizer.train_chars=200000")
    data = tmp_path / "data"
    train(load_config(TINY, tiny_overrides(tmp_path / "a", data, *extra)))
    tok = Tokenizer.load(data / "tokenizer.json")
    assert all(tok.token_id(t) is not None for t in GLM_TOKENS)
    rows = [r for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 6 and all(math.isfinite(r["loss"]) for r in rows)
    # a second run to step 3, resumed to 6: the same blanks, so the same losses
    cfg3 = load_config(TINY, tiny_overrides(tmp_path / "b", data, *extra, "train.max_steps=3"))
    train(cfg3)
    train(load_config(TINY, tiny_overrides(tmp_path / "b", data, *extra)), resume=True)
    again = [r for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if "loss" in r]
    assert [r["loss"] for r in again] == [r["loss"] for r in rows]
    out = subprocess.run([sys.executable, "-m", "lmforge", "export", str(tmp_path / "a"),
                          str(tmp_path / "hf")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "block position embedding" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("parallel.tp=2", "parallel.dp_shard=1"),
                                    ("parallel.dp_shard=2", "train.micro_batch_size=4")])
def test_tensor_parallel_and_fsdp_train_the_single_process_curve(tmp_path, layout):
    """The mask, the 2-D positions and the second table go through tensor parallelism and FSDP: two
    ranks on gloo give the one-process losses (measured within 1e-6)."""
    import os

    sets = ["objective.name=glm", "model.block_position_embedding=true", "train.max_steps=4",
            "checkpoint.every=0", "train.eval_every=2", "data.max_chars=200000",
            "data.tokenizer.train_chars=200000"]
    data = tmp_path / "data"
    env = {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, "OMP_NUM_THREADS": "1"}

    def cli(run: str, *extra: str, launcher: tuple[str, ...] = ()) -> list[dict]:
        args = [a for o in tiny_overrides(tmp_path / run, data, *sets, *extra) for a in ("--set", o)]
        cmd = [sys.executable, *launcher, "-m", "lmforge", "train", "-c", TINY, *args]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return [r for r in read_metrics(tmp_path / run / "metrics.jsonl") if "event" not in r]

    ref = cli("ref")
    from lmforge.parallel.local_ranks import free_port

    two = cli("two", *layout, launcher=("-m", "torch.distributed.run", "--nproc-per-node", "2",
                                        "--master-port", str(free_port())))
    assert [r["step"] for r in two] == [r["step"] for r in ref]
    for a, b in zip(ref, two, strict=True):
        for k in ("loss", "val_loss"):
            if k in a:
                assert abs(a[k] - b[k]) <= 1e-5, (a, b)
