"""train.master_weights=fp32: bf16 matmul weights stepped through fp32 master copies (optim/master.py).

Equality with fp32 weights under bf16 autocast: with one micro-batch and no clipping the two runs are
the same arithmetic (autocast's bf16 copy of an fp32 weight is the bf16 weight; the weight gradient is
computed in bf16 either way and the optimizer steps fp32 values), so losses and masters are compared
bit for bit. With accumulation and a norm clip the gradients are summed and scaled in bf16 (relative
rounding 2**-8) where the fp32 run does it in fp32; through AdamW (lr 1e-3, whose normalised step moves
an entry by up to lr whatever its gradient's size) that measured 4.7e-5 on the losses and 5.5e-4 on the
parameters after 5 steps; tolerances 2e-4 and 1.5e-3, below the 5e-3 (5 steps x lr) a wrong update
direction reaches.
"""

from __future__ import annotations

import pytest
import torch

from lmforge.config.schema import Config
from lmforge.engine.precision import Precision
from lmforge.engine.step import train_step
from lmforge.errors import ConfigError
from lmforge.models import build_model
from lmforge.optim.builder import build_optimizer
from lmforge.optim.master import MASTER, keep_masters, lower_weights, master_bytes, start_master_weights
from lmforge.tools.estimate import estimate

TINY = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32,
            tie_embeddings=False)
CPU = torch.device("cpu")


def _cfg(**train) -> Config:
    return Config.model_validate({"model": TINY, "optim": {"lr": 1e-3, "weight_decay": 0.1},
                                  "train": {"precision": "bf16", "micro_batch_size": 4, "seq_len": 32,
                                            **train}})


def _batches(step: int, n: int):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randint(0, 128, (4, 32), generator=g), torch.randint(0, 128, (4, 32), generator=g))
            for _ in range(n)]


def _build(master: bool, cfg: Config | None = None):
    cfg = cfg or _cfg()
    torch.manual_seed(0)
    model = build_model(cfg.model)
    masters = lower_weights(model) if master else None
    opt = build_optimizer(model, cfg.optim)
    if master:
        keep_masters(opt, masters)
    return model, opt


def _train(model, opt, steps, accum, clip, first=0) -> list[float]:
    prec = Precision("bf16", CPU)
    return [train_step(model, _batches(s, accum), opt, prec, grad_clip=clip).loss
            for s in range(first, first + steps)]


def _weights(model, opt) -> dict[str, torch.Tensor]:
    """The fp32 values the optimizer steps: a master where there is one, else the parameter."""
    return {n: opt.state[p][MASTER] if MASTER in opt.state.get(p, {}) else p.detach()
            for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_equals_fp32_weights_under_bf16_autocast_bit_for_bit(threads):
    ref_model, ref_opt = _build(False)
    model, opt = _build(True)
    lowered = [n for n, p in model.named_parameters() if p.dtype == torch.bfloat16]
    assert lowered and "tok_embeddings.weight" not in lowered and "layers.0.attn.wq.weight" in lowered
    assert _train(model, opt, 4, 1, 0.0) == _train(ref_model, ref_opt, 4, 1, 0.0)
    ref, got = _weights(ref_model, ref_opt), _weights(model, opt)
    for name, p in model.named_parameters():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], ref[name]), name
        if name in lowered:  # the stored weight is the master's bf16 rounding
            assert torch.equal(p.detach(), got[name].to(torch.bfloat16))


def test_with_accumulation_and_clip_within_bf16_rounding(threads):
    ref_model, ref_opt = _build(False)
    model, opt = _build(True)
    assert _train(model, opt, 5, 2, 0.5) == pytest.approx(_train(ref_model, ref_opt, 5, 2, 0.5), abs=2e-4)
    ref, got = _weights(ref_model, ref_opt), _weights(model, opt)
    diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert 0 < diff <= 1.5e-3


def test_resume_is_exact(threads, tmp_path):
    """The masters are optimizer state: a checkpoint holds them and a resumed run continues bit for bit."""
    from lmforge.checkpoint.manager import CheckpointManager, load_states

    model, opt = _build(True)
    straight = _train(model, opt, 4, 2, 0.5)
    model, opt = _build(True)
    first = _train(model, opt, 2, 2, 0.5)
    path = CheckpointManager(tmp_path, keep_last=1).save(2, model, opt, {})
    model, opt = _build(True)
    assert load_states(path, model, opt) == 2
    for p in model.parameters():
        if p.dtype == torch.bfloat16:  # loading casts state to the parameter's dtype: not to bf16 here
            assert opt.state[p][MASTER].dtype == opt.state[p]["exp_avg"].dtype == torch.float32
    assert first + _train(model, opt, 2, 2, 0.5, first=2) == straight


def test_memory_per_parameter_equals_the_estimate(threads):
    """Tensor bytes after a backward that follows one step (all state exists, gradients are live) equal
    the estimator's rows for the same config: weights, gradients, optimizer state, fp32 masters."""
    cfg = _cfg(master_weights="fp32")
    model, opt = _build(True, cfg)
    _train(model, opt, 1, 1, 0.0)
    x, y = _batches(9, 1)[0]
    with Precision("bf16", CPU).autocast():
        out = model(x)
    from lmforge.engine.loss import token_loss_sum

    token_loss_sum(out, y).backward()
    measured = {
        "parameters": sum(p.nbytes for p in model.parameters()),
        "gradients": sum(p.grad.nbytes for p in model.parameters()),
        "optimizer state": sum(v.nbytes for st in opt.state.values() for k, v in st.items()
                               if k != MASTER and torch.is_tensor(v)),
        "masters": master_bytes(opt),
    }
    rows = estimate(cfg).rows
    assert measured == {"parameters": rows["parameters (bf16 matmul weights, fp32 rest)"],
                        "gradients": rows["gradients (bf16 matmul weights, fp32 rest)"],
                        "optimizer state": rows["optimizer state"],
                        "masters": rows["optimizer fp32 master weights"]}
    plain = estimate(_cfg()).rows
    assert "optimizer fp32 master weights" not in plain
    n = sum(p.numel() for p in model.parameters())
    lowered = sum(p.numel() for p in model.parameters() if p.dtype == torch.bfloat16)
    # 2 bytes saved per lowered weight and gradient, 4 added for its master: the same 16 bytes as fp32
    # weights + AdamW, without autocast's per-forward 2-byte copy.
    assert sum(measured.values()) == plain["parameters (fp32)"] + plain["gradients (fp32)"] + \
        plain["optimizer state"]
    assert plain["bf16/fp16 weight copies (autocast)"] == 2 * lowered
    assert rows.get("bf16/fp16 weight copies (autocast)", 0) == 0
    assert lowered / n > 0.5


@pytest.mark.parametrize("train,needle", [
    ({"precision": "fp32"}, "train.precision=fp32 cannot run it"),
    ({"precision": "fp16"}, "train.precision=fp16 cannot run it"),
])
def test_config_refuses_precisions_it_cannot_run(train, needle):
    with pytest.raises(ValueError, match=needle):
        _cfg(master_weights="fp32", **train)


class _Dims:
    def __init__(self, world_size=1, ddp=False, zero1=False, tp=1, pp=1, ep=1):
        self.world_size, self.ddp, self.zero1, self.tp, self.pp, self.ep = world_size, ddp, zero1, tp, pp, ep


@pytest.mark.parametrize("dims,extra,resolved,needle", [
    (_Dims(), {}, "fp32", "resolved to fp32"),
    (_Dims(2), {}, "bf16", "parallel.param_dtype=bf16"),  # FSDP
    (_Dims(2, ddp=True, zero1=True), {}, "bf16", "one process or under DDP"),
    (_Dims(2, ddp=True, tp=2), {}, "bf16", "tensor / pipeline / expert"),
    (_Dims(), {"finetune": {"method": "lora"}}, "bf16", "finetune.method=lora"),
    (_Dims(), {"averaging": {"ema": True}}, "bf16", "averaging.ema/swa"),
])
def test_refused_where_it_cannot_work_and_nothing_changed(dims, extra, resolved, needle):
    cfg = _cfg(master_weights="fp32").model_copy(update={k: _cfg().__dict__[k].model_copy(update=v)
                                                        for k, v in extra.items()})
    model = build_model(cfg.model)
    with pytest.raises(ConfigError, match=needle):
        start_master_weights(cfg, dims, resolved, model)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_off_and_ddp_are_accepted():
    model = build_model(_cfg().model)
    assert start_master_weights(_cfg(), _Dims(), "bf16", model) is None
    masters = start_master_weights(_cfg(master_weights="fp32"), _Dims(2, ddp=True), "bf16", model)
    assert masters and all(m.dtype == torch.float32 for m in masters.values())
