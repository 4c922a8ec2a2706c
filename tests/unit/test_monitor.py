"""logging.monitor: the metrics beyond loss and MFU reach metrics.jsonl with the right values, and each
option that cannot work in a run is refused before the run starts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmforge.config.model import ModelConfig
from lmforge.errors import ConfigError
from lmforge.metrics.loggers import read_metrics
from lmforge.models.common.attention import Attention
from lmforge.train.monitor import attention_probs, entropy

BASE = ("checkpoint.every=0", "train.eval_every=0", "train.eval_batches=1")


def _train(tiny_cfg, tmp_path, *extra):
    from lmforge.train.trainer import Trainer

    trainer = Trainer(tiny_cfg(*BASE, *extra))
    trainer.fit()
    return trainer, read_metrics(tmp_path / "run" / "metrics.jsonl")


def test_train_records_carry_param_norm_samples_per_s_data_time_and_save_time(tiny_cfg, tmp_path):
    trainer, records = _train(tiny_cfg, tmp_path, "train.max_steps=4", "train.log_every=2",
                              "checkpoint.every=2")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [2, 4]
    seq = trainer.cfg.seq_len
    for r in train:  # packed token rows: one sample per seq_len tokens
        assert r["samples_per_s"] == pytest.approx(r["tokens_per_s"] / seq, rel=1e-9)
        assert 0 < r["data_s"] < 60
        assert not any(k.startswith("mem_") for k in r)  # CUDA only
    whole = torch.cat([p.detach().flatten() for p in trainer.model.parameters()]).norm().item()
    assert train[-1]["param_norm"] == pytest.approx(whole, rel=1e-5)
    saves = [r for r in records if "checkpoint_save_s" in r]
    assert [r["step"] for r in saves] == [2, 4] and all(0 < r["checkpoint_save_s"] < 60 for r in saves)


def test_switched_off_metrics_are_absent(tiny_cfg, tmp_path):
    _, records = _train(tiny_cfg, tmp_path, "train.max_steps=2", "train.log_every=2", "checkpoint.every=2",
                        "logging.monitor.param_norm=false", "logging.monitor.data_time=false",
                        "logging.monitor.checkpoint_time=false")
    assert records and not any(k in r for r in records for k in ("param_norm", "data_s", "checkpoint_save_s"))


def _layer(**model):
    cfg = ModelConfig(d_model=32, n_heads=4, **model)
    torch.manual_seed(0)
    return Attention(cfg).eval(), cfg


@pytest.mark.parametrize("model", [{}, {"n_kv_heads": 2}, {"qk_norm": True}, {"attn_logit_softcap": 5.0},
                                   {"qk_norm": True, "qk_norm_scope": "head"}])
def test_attention_probs_are_the_ones_the_layer_attends_with(model):
    attn, cfg = _layer(**model)
    B, T, H, D = 2, 7, attn.n_heads, attn.head_dim
    x = torch.randn(B, T, 32)
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2).float() / D)
    angles = torch.arange(T).float()[:, None] * inv  # (T, D/2)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # (T, D)
    probs = attention_probs(attn, x, (cos, sin))  # (B, H, T, T)
    assert torch.allclose(probs.sum(-1), torch.ones(B, H, T), atol=1e-6)
    assert probs.triu(1).abs().max() == 0  # causal
    v = attn.wv(x).view(B, T, attn.n_kv_heads, D).transpose(1, 2).repeat_interleave(H // attn.n_kv_heads, 1)
    ours = attn.wo((probs @ v).transpose(1, 2).reshape(B, T, H * D))
    with torch.no_grad():
        assert torch.allclose(ours, attn(x, (cos, sin)), atol=1e-5)


def test_entropy_of_uniform_causal_attention():
    T = 6
    probs = torch.ones(T, T).tril()
    probs = probs / probs.sum(-1, keepdim=True)
    assert entropy(probs) == pytest.approx(sum(math.log(t + 1) for t in range(T)) / T, rel=1e-6)
    assert entropy(F.one_hot(torch.arange(T)).float()) == 0.0


def test_attention_entropy_every_n_steps(tiny_cfg, tmp_path):
    _, records = _train(tiny_cfg, tmp_path, "train.max_steps=4", "train.log_every=1",
                        "logging.monitor.attention_entropy_every=2",
                        "logging.monitor.attention_entropy_tokens=16")
    got = {r["step"]: r.get("attention_entropy") for r in records if "loss" in r}
    assert got[1] is None and got[3] is None
    # between one-hot (0) and uniform over at most 16 keys
    assert all(0 < got[s] < math.log(16) for s in (2, 4))


@pytest.mark.parametrize("extra, says", [
    (("train.log_every=2", "logging.monitor.attention_entropy_every=3"), "multiple of train.log_every=2"),
    (("logging.monitor.attention_entropy_every=10", "logging.monitor.attention_entropy_layer=99"),
     "attention_entropy_layer=99"),
    (("logging.monitor.attention_entropy_every=10", "train.compile=true"), "train.compile=true"),
    (("logging.monitor.grad_sync_time=true",), "no one process"),
])
def test_monitor_options_that_cannot_work_are_refused_and_leave_nothing(tiny_cfg, tmp_path, extra, says):
    from lmforge.train.trainer import Trainer

    with pytest.raises(ConfigError, match=says.replace("no one process", "this run has none")):
        Trainer(tiny_cfg(*BASE, *extra))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_monitor_keys_are_validated(tiny_cfg):
    with pytest.raises(Exception, match="attention_entropy_tokens"):
        tiny_cfg("logging.monitor.attention_entropy_tokens=1")
    with pytest.raises(Exception, match="param_nrom"):
        tiny_cfg("logging.monitor.param_nrom=true")
