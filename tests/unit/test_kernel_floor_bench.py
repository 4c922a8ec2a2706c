"""bench/kernel_floor.py: the recorder sees every kernel of a whole lmforge step (forward, the autograd
backward, the optimizer), its replay runs them again, the kinds add up, and without a nanoGPT
checkout the bench says how to get one."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import kernel_floor  # noqa: E402  (bench/ is not a package)
import nanogpt_ref  # noqa: E402
import train_throughput  # noqa: E402

N_LAYERS = 2


@pytest.fixture(autouse=True)
def _keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny():
    """A 2-layer GPT-2-layout lmforge run, its step, and the number of linear calls of its forward."""
    cfg = nanogpt_ref.gpt2_config(N_LAYERS, 2, 32, 16, 64)
    data, batches = train_throughput.batches_of(cfg.vocab_size, 3, 16)
    run = train_throughput.assemble(cfg, data)
    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for m in run.model.modules()
             if isinstance(m, torch.nn.Linear)]
    step = train_throughput.stepper(run, batches)
    step(0)
    for h in hooks:
        h.remove()
    return run, step, len(calls)


def test_the_recorder_sees_forward_backward_and_the_update(tiny):
    run, step, n_linear = tiny
    calls = kernel_floor.record_step(step)
    names = [f.overloadpacket.__name__ for f, _, _ in calls]
    kinds = [kernel_floor.kind_of(n) for n in names]
    # Every linear: its forward GEMM, and in the backward the input and the weight gradient; the tied
    # output head (a plain matmul, no Linear module) the same three.
    assert kinds.count("gemm") == 3 * (n_linear + 1)
    assert kinds.count("attention") == 2 * N_LAYERS  # forward and backward kernels
    assert "gelu_backward" in names and "native_layer_norm_backward" in names
    assert "_fused_adamw_" in names  # the update
    # Copies, not the live tensors: recording changed nothing the step owns.
    params = {id(p) for p in run.model.parameters()}
    assert not any(id(a) in params for _, args, _ in calls for a in args if isinstance(a, torch.Tensor))


def test_the_replay_runs_the_same_kernels_and_the_kinds_add_up(tiny):
    _, step, _ = tiny
    calls = kernel_floor.record_step(step)
    replay = kernel_floor.replayer(calls)
    rec = kernel_floor.Recorder()
    with rec:
        replay(0)
    assert [f for f, _, _ in rec.calls] == [f for f, _, _ in calls]
    kt = kernel_floor.kernel_times(calls)
    assert sum(kt["ops"].values()) == len(calls)
    assert all(kt[k] > 0 for k in ("gemm", "attention", "other"))
    assert sum(t for _, _, t in kt["top"]) <= kt["gemm"] + kt["attention"] + kt["other"] + 1e-12


def test_kinds():
    assert kernel_floor.kind_of("mm") == kernel_floor.kind_of("addmm") == "gemm"
    assert kernel_floor.kind_of("_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert kernel_floor.kind_of("gelu") == "other"


def test_without_a_checkout_it_says_how_to_get_one(monkeypatch, capsys):
    monkeypatch.delenv(nanogpt_ref.ENV, raising=False)
    assert kernel_floor.main([]) == 2
    assert "git clone https://github.com/karpathy/nanoGPT" in capsys.readouterr().out


@pytest.mark.skipif(not os.environ.get(nanogpt_ref.ENV), reason="needs a nanoGPT checkout in LMFORGE_NANOGPT")
def test_with_a_checkout_the_bench_runs(tmp_path, capsys):
    out = tmp_path / "floor.json"
    assert kernel_floor.main(["--rounds", "3", "--threads", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "replayed kernels" in printed and out.is_file()
