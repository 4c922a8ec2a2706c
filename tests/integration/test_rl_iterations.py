"""rl.iterations (TRL's num_iterations, the GRPO paper's mu) = 2 on a tiny fine-tuned model, GRPO and PPO:
the run's weights after its two updates on one sampled batch equal two `train_step`s taken by hand on
the rollout of the same prompts (old log-probs: the sampling weights'), the third step samples the
loader's next prompts with the updated weights (each prompt once), the first update of each batch
clips nothing, a run checkpointed between the two updates resumes (and a spike rollback to such a
checkpoint redoes the second update) bit for bit, and broken or misplaced replay state is refused.
The loss for old log-probs other than the trained policy's equals TRL's GRPOTrainer (ratios in
(0.5, 2), clipping on both sides): tests/parity/test_policy_trl.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import TINY, Crash, CrashAt, tiny_overrides
from lmforge.checkpoint.manager import list_checkpoints
from lmforge.config import load_config
from lmforge.data.batch import IGNORE_INDEX, RolloutBatch
from lmforge.data.instruct_tasks import generate, split_disjoint, write_jsonl
from lmforge.engine.loss import logits_of
from lmforge.engine.objectives import PolicyGradient
from lmforge.engine.objectives.policy_gradient import ReplayBuffer
from lmforge.engine.preference_loss import token_logps
from lmforge.engine.step import train_step
from lmforge.errors import CheckpointError, ConfigError
from lmforge.metrics.loggers import read_metrics
from lmforge.train.callbacks import Callback
from lmforge.train.trainer import Trainer, train

ALGORITHMS = {"grpo": ("rl.algorithm=grpo", "rl.group_size=4"),
              "ppo": ("rl.algorithm=ppo", "rl.group_size=2", "rl.vf_coef=0.5")}
COMPARED = ("step", "loss", "grad_norm", "lr", "reward", "kl", "clip_fraction", "iteration",
            "completion_tokens", "value_loss")


@pytest.fixture(scope="module")
def world(tmp_path_factory, shared_data_dir) -> SimpleNamespace:
    """A tiny base, fine-tuned briefly on the `compare` task so that its sampled answers are sometimes
    right (groups with different rewards: non-zero GRPO advantages)."""
    tmp = tmp_path_factory.mktemp("rl_iterations")
    base, sft = tmp / "base", tmp / "sft"
    train(load_config(TINY, tiny_overrides(base, shared_data_dir, "train.max_steps=8", "checkpoint.every=0",
                                           "train.eval_every=0")))
    write_jsonl(generate(["compare"], 400, seed=5), tmp / "sft.jsonl")
    sft_args = [f"model.init_from={base}", f"sft.data=[{tmp / 'sft.jsonl'}]", f"run.dir={sft}",
                "objective.name=sft", "train.max_steps=40", "train.micro_batch_size=16", "train.seq_len=64",
                "optim.lr=5e-3", "schedule.warmup_steps=5", "train.eval_every=0", "checkpoint.every=0",
                "logging.progress=none", "train.threads=1", "sft.val_fraction=0"]
    Trainer(load_config(None, sft_args)).fit()
    write_jsonl(split_disjoint(["compare"], 120, 40, seed=9).train, tmp / "prompts.jsonl")
    return SimpleNamespace(sft=sft, prompts=tmp / "prompts.jsonl")


def config(w: SimpleNamespace, run_dir: Path, algorithm: str, *extra: str):
    return load_config(None, [
        "objective.name=rl", f"model.init_from={w.sft}", f"rl.data=[{w.prompts}]", "rl.val_fraction=0",
        "rl.iterations=2", "rl.max_new_tokens=6", "rl.beta=0.05", *ALGORITHMS[algorithm],
        f"run.dir={run_dir}",
        "train.max_steps=3", "train.micro_batch_size=4", "train.grad_accum_steps=2", "train.seq_len=64",
        "train.precision=fp32", "train.threads=1", "train.log_every=1", "train.eval_every=0",
        "checkpoint.every=0", "optim.lr=3e-3", "schedule.name=constant", "schedule.warmup_steps=0",
        "logging.progress=none", *extra,
    ])


def rows(run_dir: Path) -> list[dict]:
    return [{k: r[k] for k in COMPARED if k in r} for r in read_metrics(run_dir / "metrics.jsonl")
            if "loss" in r and "event" not in r]


class WeightsAt(Callback):
    def __init__(self, step: int) -> None:
        self.step, self.weights = step, None

    def on_step_end(self, trainer, step, result):
        if step == self.step:
            self.weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def assert_same_batches(a: list[RolloutBatch], b: list[RolloutBatch]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for name in ("input_ids", "targets", "advantages", "rewards", "old_logps", "ref_logps", "old_values",
                     "returns"):
            u, v = getattr(x, name), getattr(y, name)
            assert (u is None) == (v is None), name
            assert u is None or torch.equal(u, v), name


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_two_updates_per_sampled_batch_equal_two_steps_by_hand(world, tmp_path, algorithm):
    at2 = WeightsAt(2)
    run = Trainer(config(world, tmp_path / "run", algorithm), callbacks=[at2])
    run.fit()
    logged = rows(tmp_path / "run")
    assert [r["iteration"] for r in logged] == [1.0, 2.0, 1.0]

    # By hand, on a second copy of the same run's parts: the rollout of the loader's first two prompt
    # batches, then two plain updates (one per batch, TRL's num_iterations=1 loss) on those completions.
    ref = Trainer(config(world, tmp_path / "ref", algorithm))
    cfg, model, opt = ref.cfg, ref.model, ref.optimizer
    once = cfg.model_copy(update={"rl": cfg.rl.model_copy(update={"iterations": 1})})
    plain = PolicyGradient.from_config(once)
    assert plain.replay is None
    rollout, loader = ref.run.objective.rollout, ref.run.train_loader
    sampled = [rollout(loader.next_batch()) for _ in range(cfg.train.grad_accum_steps)]
    assert any(float(b.advantages.abs().max()) > 0 for b in sampled)  # the batch teaches something
    model.eval()
    with torch.no_grad():  # the old log-probs are the sampling weights'
        for b in sampled:
            mine = token_logps(logits_of(model(b.input_ids)), b.targets)
            torch.testing.assert_close(b.old_logps, mine, rtol=0, atol=1e-6)
    model.train()
    for step in range(2):
        ref.run.schedule.apply(opt, step, 0)
        res = train_step(model, sampled, opt, ref.precision, objective=plain, grad_clip=cfg.train.grad_clip)
        assert res.loss == logged[step]["loss"] and res.grad_norm == logged[step]["grad_norm"]
        assert res.metrics["clip_fraction"] == logged[step]["clip_fraction"]
    weights = model.state_dict()
    assert at2.weights.keys() == weights.keys()
    for k, v in at2.weights.items():
        assert torch.equal(v, weights[k]), k  # bit for bit

    assert logged[0]["clip_fraction"] == 0.0 == logged[2]["clip_fraction"]  # ratio 1 on a first update
    assert logged[1]["clip_fraction"] > 0.0  # the second update's ratio is to the sampling policy

    # Step 3 sampled the loader's next prompts (the replay drew none) with the weights after step 2.
    fresh = [rollout(loader.next_batch()) for _ in range(cfg.train.grad_accum_steps)]
    assert run.replay.uses == 1
    assert_same_batches(run.replay.batches, fresh)
    assert not torch.equal(fresh[0].input_ids, sampled[0].input_ids)
    assert run.run.train_loader.state_dict() == loader.state_dict()
    ref.run.release()


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_checkpoint_between_the_updates_resumes_and_rolls_back_bit_for_bit(world, tmp_path, algorithm):
    # step 3 is the first update of the second batch; validation there samples greedily, keeping nothing
    steps = ("train.max_steps=6", "checkpoint.every=3", "train.eval_every=3", "rl.val_fraction=0.1")
    straight = Trainer(config(world, tmp_path / "straight", algorithm, *steps))
    straight.fit()
    with pytest.raises(Crash):
        Trainer(config(world, tmp_path / "crashed", algorithm, *steps), callbacks=[CrashAt(4)]).fit()
    ckpt = list_checkpoints(tmp_path / "crashed" / "checkpoints")[-1].path
    saved = torch.load(ckpt / "rank_00000.pt", weights_only=True)["states"]["replay"]
    assert saved["uses"] == 1 and len(saved["batches"]) == 2  # the batch's second update is still to come
    resumed = Trainer(config(world, tmp_path / "crashed", algorithm, *steps), resume=True)
    assert resumed.step == 3
    resumed.fit()
    assert rows(tmp_path / "straight") == rows(tmp_path / "crashed")
    val = [r for r in read_metrics(tmp_path / "straight" / "metrics.jsonl") if "val_reward" in r]
    assert [r["step"] for r in val] == [3, 6] and not any("val_iteration" in r for r in val)
    assert val == [r for r in read_metrics(tmp_path / "crashed" / "metrics.jsonl") if "val_reward" in r]
    assert [r["iteration"] for r in rows(tmp_path / "straight")] == [1.0, 2.0] * 3
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)

    # A loss-spike rollback to step 3's checkpoint restores the kept batch with the weights: the redone
    # step 4 is its second update again, equal to the straight run's.
    straight._load_checkpoint(list_checkpoints(tmp_path / "straight" / "checkpoints")[0].path, full=False)
    assert straight.step == 3 and straight.replay.uses == 1
    redone = straight._train_step()
    step4 = rows(tmp_path / "straight")[3]
    assert (redone.loss, redone.grad_norm) == (step4["loss"], step4["grad_norm"])
    assert redone.metrics["iteration"] == 2


def test_a_broken_replay_state_is_refused_on_resume(world, tmp_path):
    run_dir = tmp_path / "run"
    Trainer(config(world, run_dir, "grpo", "checkpoint.every=3")).fit()
    ckpt = list_checkpoints(run_dir / "checkpoints")[-1].path
    state = torch.load(ckpt / "rank_00000.pt", weights_only=True)
    state["states"]["replay"]["batches"][1]["old_logps"] = torch.zeros(3)
    torch.save(state, ckpt / "rank_00000.pt")
    why = r"'replay' state is malformed.*old_logps is torch.float32 \(3,\)"
    with pytest.raises(CheckpointError, match=why):
        Trainer(config(world, run_dir, "grpo", "train.max_steps=4"), resume=True)


def _batch(rows: int = 4, width: int = 7, **kw) -> RolloutBatch:
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(2, 40, (rows, width), generator=g)
    targets = torch.full((rows, width), IGNORE_INDEX)
    targets[:, 2 : width - 1] = ids[:, 3:]
    return RolloutBatch(ids, targets, torch.randn(rows, generator=g), torch.rand(rows, generator=g), 2,
                        old_logps=-torch.rand(rows, width, generator=g),
                        reward_parts={"format": torch.ones(rows)}, real_tokens=rows * width, **kw)


def test_replay_buffer_keeps_one_sampled_batch_for_its_updates_and_checks_what_it_loads():
    buf = ReplayBuffer(3)
    buf.add(_batch())  # outside a step that sampled: not kept
    assert buf.take() is None and buf.batches == []
    first = [_batch(), _batch(6)]
    for b in first:
        buf.add(b)
    assert [b.iteration for b in buf.take()] == [2, 2] and [b.iteration for b in buf.take()] == [3, 3]
    buf.add(_batch())  # a replayed step samples nothing new
    assert buf.take() is None and buf.batches == [] and buf.uses == 1
    for b in first:
        buf.add(b)
    sd = buf.state_dict()
    other = ReplayBuffer(3)
    other.load_state_dict(sd)
    again = other.take()
    assert_same_batches(again, first)
    assert again[1].reward_parts.keys() == {"format"} and again[1].real_tokens == 42
    assert ReplayBuffer(3).state_dict()["batches"] == []

    def one(**field):  # the saved state with one field of its first batch replaced
        return {"batches": [{**first[0].state(), **field}]}

    broken = [({"uses": -1}, "negative"), ({"uses": 1.0}, "uses is float"),
              (one(input_ids=torch.zeros(4, 7)), "input_ids is torch.float32"),
              (one(advantages=torch.zeros(4, 7)), r"advantages .* \(4,\)"),
              (one(group_size=3), "group size dividing"),
              (one(reward_parts={"format": torch.ones(2)}), "reward_parts"),
              ({"batches": [{"input_ids": first[0].input_ids}]}, "lacks targets")]
    for change, why in broken:
        with pytest.raises(ValueError, match=why):
            ReplayBuffer(3).load_state_dict({**sd, **change})
    # a kept batch belongs to the rank that sampled it: another layout cannot take its updates over
    elsewhere = ReplayBuffer(3)
    elsewhere.place(1, 2)
    with pytest.raises(ConfigError, match="rank 0 of 1.*rank 1 of 2"):
        elsewhere.load_state_dict(sd)
    elsewhere.load_state_dict({**sd, "batches": []})  # nothing left to replay: any layout resumes


def test_iterations_with_a_batch_ramp_are_refused(world, tmp_path):
    with pytest.raises(ConfigError, match="rl.iterations=2.*train.batch_warmup_tokens"):
        PolicyGradient.from_config(config(world, tmp_path, "grpo", "train.batch_warmup_tokens=4096"))
    with pytest.raises(ConfigError, match="rl.iterations"):
        config(world, tmp_path, "grpo", "rl.iterations=0")
