"""The stability components on their own: EMA/SWA against torch's AveragedModel, the robust
z-score, the spike detector, early stopping, the non-finite guard and the batch-size ramp."""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, get_swa_multi_avg_fn

from lmforge.config import Config, ModelConfig, StabilityConfig
from lmforge.models import build_model
from lmforge.optim.batch_ramp import BatchRamp
from lmforge.parallel.checkpointing import apply_activation_checkpointing
from lmforge.train.averaging import WeightAverage, clean_name
from lmforge.train.callbacks import EarlyStopping
from lmforge.train.stability import NonFiniteGuard, SpikeDetector, robust_z


def trained_steps(model, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(n):
        x = torch.randint(0, 97, (2, 8), generator=g)
        model(x).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
        yield


@pytest.mark.parametrize("kind", ["ema", "swa"])
def test_average_equals_torch_averaged_model(kind):
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="debug", vocab_size=97, max_seq_len=16))
    ours = WeightAverage(model, kind, decay=0.9)
    avg_fn = get_ema_multi_avg_fn(0.9) if kind == "ema" else get_swa_multi_avg_fn()
    ref = AveragedModel(model, multi_avg_fn=avg_fn)
    for _ in trained_steps(model, 12):
        ours.update(model)
        ref.update_parameters(model)
    for name, p in ref.module.named_parameters():
        assert torch.equal(ours.params[name], p), name  # the same foreach arithmetic: bit-identical
    assert ours.n_averaged == int(ref.n_averaged) == 12


def test_average_swaps_in_and_back_and_ignores_wrappers():
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="debug", vocab_size=97, max_seq_len=16))
    apply_activation_checkpointing(model, "full", 1)
    avg = WeightAverage(model, "swa")
    assert all("_checkpoint_wrapped_module" not in n for n in avg.params)
    wrapped = "module.layers.0._checkpoint_wrapped_module.attn.wq.weight"
    assert clean_name(wrapped) == "layers.0.attn.wq.weight"
    steps = trained_steps(model, 3)
    next(steps)
    avg.update(model)
    next(steps)
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    with avg.swapped_into(model):
        assert all(torch.equal(p, avg.params[clean_name(n)]) for n, p in model.named_parameters())
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())


def test_robust_z_is_iglewicz_hoaglin():
    hist = [1.0, 2.0, 3.0, 4.0, 100.0]  # median 3, MAD median(|.|)=median(2,1,0,1,97)=1
    z, med = robust_z(5.0, hist)
    assert med == 3.0 and z == pytest.approx(0.6745 * 2.0)


def test_spike_detector_judges_only_after_history_and_never_learns_spikes():
    cfg = StabilityConfig(spike_detection=True, spike_window=10, spike_min_history=5, spike_z=6)
    det = SpikeDetector(cfg)
    noise = [5.0, 5.02, 4.98, 5.01, 4.99]
    assert all(det.check(x) is None for x in [50.0] + noise[1:])  # too little history to judge the 50
    spike = det.check(6.0)
    assert spike is not None and spike.z > 6 and spike.median == pytest.approx(5.0, abs=0.02)
    assert 6.0 not in det.history
    assert det.check(4.0) is None  # a drop is never a spike
    assert det.check(float("nan")) is None
    state = det.state_dict()
    again = SpikeDetector(StabilityConfig(spike_detection=True, spike_window=10, spike_min_history=5))
    again.load_state_dict(state)
    assert again.history == det.history


def test_early_stopping_patience_and_min_delta():
    es = EarlyStopping(patience=2, min_delta=0.01)
    assert es.observe(3.0, 10) and not es.should_stop
    assert not es.observe(2.995, 20)  # better, but by less than min_delta
    assert es.observe(2.9, 30) and es.best_step == 30
    assert not es.observe(2.95, 40) and not es.should_stop
    assert not es.observe(2.91, 50) and es.should_stop
    assert not EarlyStopping(0, 0.0).should_stop


def test_nonfinite_guard_counts_consecutive():
    g = NonFiniteGuard(3)
    assert [g.observe(f) for f in (False, False, True, False, False, False)] == [False] * 5 + [True]


def ramp_cfg(**train):
    return Config.model_validate({"model": {"max_seq_len": 64}, "train": {"micro_batch_size": 8, **train}})


def test_batch_ramp_grows_linearly_in_micro_batches():
    r = BatchRamp(ramp_cfg(grad_accum_steps=8, batch_warmup_tokens=100_000), dp_size=2)
    assert r.micro_tokens == 8 * 64 * 2
    assert r.micro_batches(0) == 1 and r.micro_batches(100_000) == 8
    seen, sizes = 0, []
    while seen < 100_000:
        sizes.append(r.micro_batches(seen))
        seen += r.tokens_per_step(seen)
    assert sizes == sorted(sizes) and sizes[0] == 1 and set(range(1, 9)) >= set(sizes)
    assert r.total_tokens(len(sizes) + 10) == seen + 10 * 8 * r.micro_tokens


def test_batch_ramp_start_and_off():
    r = BatchRamp(ramp_cfg(grad_accum_steps=8, batch_warmup_tokens=50_000, batch_warmup_start_tokens=2048), 1)
    assert r.start == 4 and r.micro_batches(0) == 4
    off = BatchRamp(ramp_cfg(grad_accum_steps=4), 1)
    assert off.micro_batches(0) == 4 and off.total_tokens(10) == 10 * 4 * 512
    assert math.isclose(off.tokens_per_step(123), 2048)
