"""`lmforge estimate`: activation bytes against autograd's saved tensors (exact), optimizer state against
the real optimizers after a step (exact), model states against DeepSpeed's ZeRO formulas and accelerate's
`estimate_training_usage` where they overlap, suggestions that fit, and the CLI's errors."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from lmforge.cli import main
from lmforge.config.schema import Config
from lmforge.data.batch import TokenBatch
from lmforge.engine.loss import token_loss_sum
from lmforge.engine.objectives import CausalLM
from lmforge.models.transformer import build_model
from lmforge.optim.builder import build_optimizer
from lmforge.tools.estimate import apply_changes, estimate, suggest
from lmforge.tools.estimate_parts import activation_profile, model_tensors, optimizer_state_bytes

TINY = dict(d_model=64, n_layers=2, n_heads=4, vocab_size=300, max_seq_len=64)


def _cfg(model=None, train=None, optim=None, parallel=None) -> Config:
    return Config.model_validate({"model": {**TINY, **(model or {})}, "train": train or {},
                                  "optim": optim or {"name": "adamw"}, "parallel": parallel or {}})


def _saved_bytes(cfg: Config, B: int, T: int, precision: str, packed: bool) -> int:
    """Bytes of the distinct storages autograd saves for one forward (parameters and buffers excluded)."""
    torch.manual_seed(0)
    model = build_model(cfg.model)
    model.train()
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (B, T), generator=g)
    y = torch.randint(0, cfg.model.vocab_size, (B, T), generator=g)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    autocast = torch.autocast("cpu", torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        if packed:
            seg = torch.zeros(B, T, dtype=torch.long)
            seg[:, T // 2:] = 1
            pos = torch.cat([torch.arange(T // 2), torch.arange(T - T // 2)]).expand(B, T)
            token_loss_sum(model(x, segment_ids=seg, position_ids=pos), y)
        else:
            CausalLM(cfg.train.loss_chunk_tokens)(model, TokenBatch(x, y))
    return sum(seen.values())


@pytest.mark.parametrize("model,train,B,T,precision,packed", [
    ({}, {}, 2, 32, "fp32", False),
    ({}, {}, 3, 40, "bf16", False),
    ({"n_kv_heads": 2, "sliding_window": 16}, {}, 2, 48, "fp32", False),
    ({"n_kv_heads": 1}, {}, 2, 32, "bf16", False),
    ({"pos_embedding": "learned", "mlp": "gelu", "norm": "layernorm", "bias": True, "tie_embeddings": False},
     {}, 2, 32, "fp32", False),
    ({"pos_embedding": "learned", "mlp": "gelu", "norm": "layernorm", "bias": True, "tie_embeddings": False},
     {}, 2, 32, "bf16", False),
    ({}, {}, 2, 32, "fp32", True),
    ({}, {"loss_chunk_tokens": 16}, 2, 32, "fp32", False),
    ({"dropout": 0.1}, {}, 2, 32, "fp32", False),
])
def test_saved_activations_match_autograd(model, train, B, T, precision, packed):
    cfg = _cfg(model, {"precision": precision, **train})
    prof = activation_profile(cfg, B, T, precision, "cpu", list(range(cfg.model.n_layers)), True, True,
                              packed=packed)
    # under autocast the saved tensors include the bf16 weight copies, a row of their own
    copies = 0
    if precision == "bf16":
        copies = 2 * sum(t.local for t in model_tensors(cfg.model).tensors if t.matmul)
    assert prof.saved + copies == _saved_bytes(cfg, B, T, precision, packed)  # exact, to the byte


def test_checkpointed_blocks_keep_their_input_only():
    cfg = _cfg(train={"activation_checkpointing": "every_k", "ac_every": 2})
    prof = activation_profile(cfg, 2, 32, "fp32", "cpu", [0, 1], True, True)
    assert prof.per_block == [2 * 32 * 64 * 4, prof.block_full]


@pytest.mark.parametrize("optim", [
    {"name": "adamw"}, {"name": "adam"}, {"name": "sgd"}, {"name": "sgd", "sgd": {"momentum": 0.0}},
    {"name": "lion"}, {"name": "adafactor"}, {"name": "adafactor", "adafactor": {"beta1": 0.9}},
    {"name": "adamw8bit", "adamw8bit": {"block_size": 64, "min_size": 1024}}, {"name": "sophia"},
    {"name": "muon"},
])
def test_optimizer_state_matches_the_real_optimizer(optim):
    cfg = _cfg(optim=optim)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg.optim)
    x = torch.randint(0, 300, (2, 16))
    token_loss_sum(model(x), x).backward()
    opt.step()
    real = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))
    assert optimizer_state_bytes(model_tensors(cfg.model).tensors, cfg.optim, "cpu") == real


# DeepSpeed's formulas, as deepspeed/runtime/zero/stage_1_and_2.py and stage3.py define them
# (github.com/deepspeedai/DeepSpeed, documented at deepspeed.readthedocs.io/en/latest/memory.html);
# deepspeed is not installed. Without offload, per GPU:
#   ZeRO-2: 4 * P (fp16 params + fp16 grads, whole) + 16 * P / N (fp32 master params, fp32 grads,
#           Adam's m and v, partitioned)
#   ZeRO-3: 4 * largest_layer_params (gathered fp16 params and grads of one layer) + 18 * P / N
def ds_zero2_gpu(total_params: int, gpus: int) -> int:
    return 4 * total_params + int(16 * total_params / gpus)


def ds_zero3_gpu(total_params: int, largest_layer_params: int, gpus: int) -> int:
    return 4 * largest_layer_params + int(18 * total_params / gpus)


def _sharded_states(est) -> int:
    """fp32 params + fp32 grads + Adam moments on a rank, less the 4-byte step counters."""
    n_tensors = len(model_tensors(est.cfg.model).tensors)
    return (est.rows["parameters (sharded, fp32)"] + est.rows["gradients (sharded, fp32)"]
            + est.rows["optimizer state"] - 4 * n_tensors)


@pytest.mark.parametrize("n", [2, 4])
def test_zero_model_states_match_deepspeed(n):
    """The overlap with DeepSpeed: its partitioned 16 bytes per parameter (fp32 master, fp32 grad, m,
    v) are exactly lmforge's sharded fp32 params + grads + AdamW state under FSDP ZeRO-2 and ZeRO-3
    (lmforge trains the fp32 params themselves: they are the master copy). DeepSpeed adds 4 P whole
    (fp16 params and grads) at ZeRO-2 and 2 P / N (an fp16 param partition) + 4 x the largest layer at
    ZeRO-3, which lmforge does not keep: FSDP casts while gathering."""
    model = {"d_model": 128, "n_heads": 4, "n_layers": 4, "vocab_size": 512}  # every dim 0 divides by n
    P = sum(t.numel for t in model_tensors(_cfg(model).model).tensors)
    for zero, ds in ((2, ds_zero2_gpu(P, n) - 4 * P), (3, ds_zero3_gpu(P, 0, n) - int(2 * P / n))):
        est = estimate(_cfg(model, parallel={"zero": zero}), world_size=n)
        assert _sharded_states(est) == ds


def test_single_process_states_match_accelerate():
    """accelerate's estimate_training_usage for a model of `bytes` (fp32): float32 -> model = bytes,
    gradients = bytes, optimizer (Adam) = 2 x bytes, the same as lmforge's fp32 AdamW rows (less the
    step counters); bfloat16 -> gradients = bytes + bytes / 2, the fp32 gradients plus the half-size
    copies, which is lmforge's gradients + autocast weight copies for the matmul weights (accelerate's
    P counts every weight as a matmul weight: norms are excluded from the comparison)."""
    from accelerate.commands.estimate import estimate_training_usage

    cfg = _cfg({"d_model": 128, "n_layers": 3})
    tensors = model_tensors(cfg.model).tensors
    n_bytes = 4 * sum(t.numel for t in tensors)
    ref = estimate_training_usage(n_bytes, "float32")
    est = estimate(cfg)
    assert est.rows["parameters (fp32)"] == ref["model"]
    assert est.rows["gradients (fp32)"] == ref["gradients"]
    assert est.rows["optimizer state"] - 4 * len(tensors) == ref["optimizer"]
    low = estimate(apply_changes(cfg, {"train.precision": "bf16"}))
    matmul_bytes = 4 * sum(t.numel for t in tensors if t.matmul)
    ref16 = estimate_training_usage(matmul_bytes, "bfloat16")
    assert matmul_bytes + low.rows["bf16/fp16 weight copies (autocast)"] == ref16["gradients"]


def test_layouts_divide_what_they_shard():
    cfg = _cfg({"d_model": 128, "vocab_size": 512}, {"micro_batch_size": 4})
    one = estimate(cfg)
    ddp = estimate(apply_changes(cfg, {"parallel.dp_replicate": 2, "parallel.dp_shard": 1}), 2)
    z1 = estimate(apply_changes(cfg, {"parallel.zero": 1}), 2)
    z3 = estimate(apply_changes(cfg, {"parallel.zero": 3}), 2)
    tp = estimate(apply_changes(cfg, {"parallel.tp": 2, "parallel.dp_shard": 1}), 2)
    assert ddp.rows["DDP gradient buckets"] == one.rows["gradients (fp32)"]
    assert z1.rows["optimizer state"] < 0.6 * one.rows["optimizer state"]
    assert z3.rows["parameters (sharded, fp32)"] == one.rows["parameters (fp32)"] // 2
    assert tp.rows["activations (saved for backward)"] < one.rows["activations (saved for backward)"]
    assert one.peak == max(one.moments.values())


def test_suggestions_fit_when_estimated_again():
    cfg = _cfg({"d_model": 128, "vocab_size": 4096, "max_seq_len": 256}, {"micro_batch_size": 16})
    peak = estimate(cfg).peak
    budget = int(peak * 0.6)
    tips = suggest(cfg, 1, "cpu", budget)
    assert tips
    for tip in tips:
        assert tip.peak <= budget
        assert estimate(apply_changes(cfg, tip.change)).peak == tip.peak


def test_cli_prints_a_verdict(capsys):
    rc = main(["estimate", "--set", "model.vocab_size=512", "--set", "model.d_model=64",
               "--device-memory", "64"])
    out = capsys.readouterr().out
    assert rc == 0 and "verdict" in out and "fits" in out
    rc = main(["estimate", "--set", "model.vocab_size=512", "--device-memory", "0.01", "--json"])
    assert rc == 1
    assert '"fits": false' in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [
    (["--set", "train.micro_batch_sise=4"], "micro_batch_sise"),
    (["--set", "train.activation_checkpointing=some"], "activation_checkpointing"),
    (["--set", "model.vocab_size=512", "--world-size", "0"], "--world-size"),
    (["--set", "model.vocab_size=512", "--world-size", "-3"], "--world-size"),
    (["--set", "model.vocab_size=512", "--set", "parallel.tp=2", "--world-size", "3"], "world size"),
    (["--set", "model.vocab_size=512", "--device-memory", "-1"], "--device-memory"),
    (["--set", "model.vocab_size=512", "--device", "tpu"], "--device"),
])
def test_cli_errors_exit_2_naming_the_key(argv, needle, capsys):
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_bad_config_file_names_the_key(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  vocab_size: 512\n  d_modle: 64\n")
    assert main(["estimate", "-c", str(path)]) == 2
    assert "d_modle" in capsys.readouterr().err


def test_shard_padding_rounds_dim0_up():
    cfg = _cfg({"vocab_size": 301})
    est = estimate(apply_changes(cfg, {"parallel.zero": 3}), 2)
    table = math.ceil(301 / 2) * 64 * 4
    assert est.rows["parameters (sharded, fp32)"] >= table


@pytest.mark.parametrize("moe", [
    {"n_experts": 4, "top_k": 2},
    {"n_experts": 4, "top_k": 1, "norm_topk_prob": False, "router_score": "sigmoid", "bias_balancing": True},
    {"n_experts": 8, "top_k": 2, "d_ff_expert": 48, "n_shared_experts": 2, "shared_d_ff": 40,
     "shared_gate": True},
    {"n_experts": 4, "top_k": 2, "capacity_factor": 8.0},  # a capacity that drops nothing
])
def test_moe_saved_activations_match_autograd(moe):
    """The MoE layer's saved tensors, to the byte: dropless, the total over the experts does not depend on
    how the router spreads the rows, so any routing checks it."""
    cfg = _cfg({"moe": moe})
    prof = activation_profile(cfg, 2, 32, "fp32", "cpu", [0, 1], True, True)
    assert prof.saved == _saved_bytes(cfg, 2, 32, "fp32", False)


def test_expert_parallel_splits_the_experts_only():
    cfg = _cfg({"moe": {"n_experts": 4, "top_k": 2}}, {"micro_batch_size": 2})
    ddp = estimate(apply_changes(cfg, {"parallel.dp_replicate": 2, "parallel.dp_shard": 1}), 2)
    ep = estimate(apply_changes(cfg, {"parallel.dp_replicate": 2, "parallel.dp_shard": 1,
                                      "parallel.ep": 2}), 2)
    experts = sum(t.numel for t in model_tensors(cfg.model).tensors if t.expert)
    assert experts > 0
    assert ddp.rows["parameters (fp32)"] - ep.rows["parameters (fp32)"] == experts // 2 * 4
    assert ddp.rows["DDP gradient buckets"] - ep.rows["DDP gradient buckets"] == experts * 4


@pytest.mark.parametrize("schedule,v,m,rank,inflight", [
    ("gpipe", 1, 4, 0, 4), ("gpipe", 1, 4, 1, 4), ("1f1b", 1, 4, 0, 2), ("1f1b", 1, 4, 1, 1),
    ("interleaved_1f1b", 2, 4, 0, 5), ("interleaved_1f1b", 2, 4, 1, 3),
])
def test_pipeline_operations_follow_torch_schedules(schedule, v, m, rank, inflight):
    """Every (micro-batch, stage) runs forward then backward once, and the most held at once is the
    schedule's warm-up depth (1F1B: pp - rank; interleaved: torch's warm-up count + 1)."""
    from lmforge.tools.estimate import pipeline_ops

    ops = pipeline_ops(schedule, 2, v, m, rank)
    assert sorted(o for o in ops if o[0] == "F") == sorted(("F", i, s) for i in range(m) for s in range(v))
    live, most = set(), 0
    for kind, mb, s in ops:
        if kind == "F":
            live.add((mb, s))
            most = max(most, len(live))
        else:
            assert (mb, s) in live
            live.remove((mb, s))
    assert not live and most == inflight


def test_pipeline_ops_match_torch_interleaved_order():
    """The interleaved order is ScheduleInterleaved1F1B's own operation list (its private helpers)."""
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    from lmforge.tools.estimate import pipeline_ops

    pp, v, m = 2, 2, 4
    per_round = m // max(1, m // pp)
    total = v * m
    for rank in range(pp):
        warm = sched._get_warmup_ops(rank, v, per_round, pp, m, multiply_factor=2)
        ref = sched._get_1f1b_rank_ops(
            v, pp, warm, total - warm, warm, rank,
            lambda step, r=rank: ((step // per_round) % v) * pp + r,
            lambda step, r=rank, w=warm: (v - 1 - ((step - w) // per_round) % v) * pp + r)
        ref = [("F" if a.computation_type == sched._ComputationType.FORWARD else "B", a.microbatch_index,
                a.stage_index // pp) for a in ref if a is not None]
        assert pipeline_ops("interleaved_1f1b", pp, v, m, rank) == ref


def test_encoder_is_refused_naming_the_key(capsys):
    argv = ["estimate", "--set", "model.arch=encoder", "--set", "model.pos_embedding=learned",
            "--set", "model.vocab_size=512"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "model.arch=encoder" in err and "Traceback" not in err
