"""A layout that cannot work is a ConfigError at start-up naming the parallel.* / model.* keys, the
world size and what would fit - never a hang or a shape error inside a collective. (A real
2-process job failing this way is in test_two_ranks.)"""

from __future__ import annotations

import pytest

from lmforge.config.schema import ModelConfig, ParallelConfig
from lmforge.errors import ConfigError
from lmforge.parallel.dims import ParallelDims

MODEL = ModelConfig(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32)


def resolve(world: int, model: ModelConfig = MODEL, accum: int = 2, **parallel) -> ParallelDims:
    return ParallelDims.resolve(ParallelConfig(**parallel), world, model, accum)


def test_fill_and_degrees():
    d = resolve(8, tp=2, pp=2)
    assert (d.dp_replicate, d.dp_shard, d.tp, d.pp, d.dp_size) == (1, 2, 2, 2, 2)
    assert d.fsdp and not d.ddp
    assert resolve(2, dp_replicate=2).ddp
    assert resolve(4, dp_shard=4, zero=1).zero1
    assert resolve(4, dp_replicate=2, tp=2).fsdp  # replicas beside TP go through FSDP2 (HSDP)


@pytest.mark.parametrize("world,parallel,needles", [
    (6, dict(tp=4), ["parallel.tp=4", "world size 6"]),
    (4, dict(dp_shard=3), ["dp_shard=3", "world size is 4", "dp_shard=4"]),
    (8, dict(dp_shard=2, tp=2), ["= 4 processes", "world size is 8", "dp_shard=4 with these"]),
])
def test_layout_not_matching_world_size(world, parallel, needles):
    with pytest.raises(ConfigError) as e:
        resolve(world, **parallel)
    for n in needles:
        assert n in str(e.value)


def test_heads_not_divisible_by_tp():
    with pytest.raises(ConfigError, match=r"model.n_kv_heads=2 is not divisible by parallel.tp=4"):
        resolve(4, tp=4)
    with pytest.raises(ConfigError, match=r"model.n_heads=6 is not divisible by parallel.tp=4"):
        resolve(4, ModelConfig(d_model=96, n_layers=4, n_heads=6, vocab_size=128), tp=4)


def test_dropout_under_tp():
    with pytest.raises(ConfigError, match=r"model.dropout=0.1 with parallel.tp=2"):
        resolve(2, MODEL.model_copy(update={"dropout": 0.1}), tp=2)


def test_layers_not_divisible_into_stages():
    with pytest.raises(ConfigError, match=r"model.n_layers=4 cannot be split into parallel.pp=2 x "
                                          r"parallel.pp_stages_per_rank=3 = 6"):
        resolve(2, pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=3, pp_microbatches=2)
    with pytest.raises(ConfigError, match=r"model.n_layers=3 .* parallel.pp=2"):
        resolve(2, ModelConfig(d_model=64, n_layers=3, n_heads=4, vocab_size=128), pp=2)


@pytest.mark.parametrize("parallel,accum,match", [
    (dict(pp=2, pp_schedule="interleaved_1f1b"), 2, "needs parallel.pp_stages_per_rank >= 2"),
    (dict(pp=2, pp_schedule="1f1b", pp_stages_per_rank=2), 2, "set it to 1 or use interleaved_1f1b"),
    (dict(pp=2, pp_schedule="1f1b"), 1, "at least parallel.pp=2 micro-batches"),
    (dict(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2, pp_microbatches=5), 2,
     "multiple of 2"),
])
def test_schedule_vs_stages_and_microbatches(parallel, accum, match):
    with pytest.raises(ConfigError, match=match):
        resolve(2, accum=accum, **parallel)


def test_strategy_combinations():
    with pytest.raises(ConfigError, match="parallel.zero=1 .* use parallel.zero=2 or 3"):
        resolve(4, dp_shard=2, tp=2, zero=1)
    with pytest.raises(ConfigError, match="parallel.cpu_offload=true .* has no FSDP"):
        resolve(2, dp_replicate=2, cpu_offload=True)
    with pytest.raises(ConfigError, match="pp_stages_per_rank=2 needs parallel.pp > 1"):
        resolve(2, pp_stages_per_rank=2)
