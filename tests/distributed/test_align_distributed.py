"""Alignment objectives on 2 real gloo ranks under DDP (parallel.dp_replicate=2): DPO (LoRA, the base as
reference) and a reward model (full fine-tuning, score head) train the single-process curve on the same
global batch (micro_batch_size doubled), as SFT does in test_sft_distributed; GRPO trains, validates
and checkpoints (its completions are sampled per rank with seeds of their own, so it has no
single-process twin), and a resumed DDP run of it continues bit for bit; so does one with two updates
per sampled batch (rl.iterations=2), checkpointed between them (each rank keeps its own batch; slow tier).

The workers are test_sft_distributed's: one process group per rank trains every scenario in turn.
Tolerance: test_sft_distributed's (fp32; only the order of float sums differs)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_sft_distributed import PARAM_TOL, STEPS, TOL, curve, final_weights, launch

# Slow tier (CI runs it): two 2-rank launches (~30 s); DDP itself stays in the default tier
# (test_two_ranks.py) and DPO/reward/GRPO in one process (tests/integration).
pytestmark = pytest.mark.slow

B = 2  # pairs / prompts per rank per micro-batch; the single process takes 2 * B
DDP = ("parallel.dp_replicate=2", "parallel.dp_shard=1")
MU2 = ("rl.iterations=2",)
COMPARED = {"dpo": ("loss", "grad_norm", "lr", "val_loss", "reward_accuracy", "val_reward_margin"),
            "reward": ("loss", "grad_norm", "lr", "val_loss", "accuracy", "val_accuracy")}


def overrides(w: dict, objective: str, run_dir: Path, rows: int, *extra: str) -> list[str]:
    data = {
        "dpo": (f"preference.data=[{w['pairs']}]", "preference.val_fraction=0.15", "finetune.method=lora",
                "finetune.r=4"),
        # SGD, not AdamW: a pairwise loss's gradients on the prompt tokens that chosen and rejected share
        # nearly cancel, and Adam's normalisation turns the float-order noise of such a sum into weight
        # differences of ~1e-6 (measured: 1.2e-6 on an embedding row); SGD's update is the gradient itself
        "reward": (f"preference.data=[{w['pairs']}]", "preference.val_fraction=0.15", "optim.name=sgd",
                   "optim.lr=0.05"),
        "rl": (f"rl.data=[{w['prompts']}]", "rl.val_fraction=0.1", "rl.group_size=4", "rl.max_new_tokens=6",
               "finetune.method=lora", "finetune.r=4"),
    }[objective]
    start = w["sft"] if objective == "rl" else w["base"]
    return [
        f"objective.name={objective}", f"model.init_from={start}", f"run.dir={run_dir}",
        f"train.max_steps={STEPS}", f"train.micro_batch_size={rows}", "train.grad_accum_steps=2",
        "train.seq_len=64", "train.precision=fp32", "train.threads=1", "train.log_every=1",
        "train.eval_every=3", "train.eval_batches=2", "checkpoint.every=3", "checkpoint.keep_last=3",
        "schedule.warmup_steps=2", "logging.progress=none", "parallel.timeout_s=120",
        *(("optim.lr=1e-3",) if objective != "reward" else ()), *data, *extra,
    ]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, shared_data_dir):
    """The base model, the SFT model GRPO starts from, the data and the single-process references."""
    from conftest import TINY, tiny_overrides
    from lmforge.config import load_config
    from lmforge.data.instruct_tasks import generate, pairs_of, write_jsonl
    from lmforge.train.trainer import Trainer, train

    tmp = tmp_path_factory.mktemp("align_dist")
    w = {"base": tmp / "base", "pairs": tmp / "pairs.jsonl", "prompts": tmp / "prompts.jsonl"}
    base = tiny_overrides(w["base"], shared_data_dir, "train.max_steps=8", "checkpoint.every=0",
                          "train.eval_every=0")
    train(load_config(TINY, base))
    write_jsonl(pairs_of(generate(None, 300, seed=3), 3), w["pairs"])
    write_jsonl(generate(["compare"], 200, seed=4), w["prompts"])
    # GRPO starts from a briefly fine-tuned model, whose sampled answers are sometimes right
    write_jsonl(generate(["compare"], 400, seed=5), tmp / "sft.jsonl")
    sft = [f"model.init_from={w['base']}", f"sft.data=[{tmp / 'sft.jsonl'}]", f"run.dir={tmp / 'sft'}",
           "objective.name=sft", "train.max_steps=40", "train.micro_batch_size=16", "train.seq_len=64",
           "optim.lr=5e-3", "schedule.warmup_steps=5", "train.eval_every=0", "checkpoint.every=0",
           "logging.progress=none", "train.threads=1", "sft.val_fraction=0"]
    Trainer(load_config(None, sft)).fit()
    w["sft"] = tmp / "sft"
    refs = {}
    for objective in ("dpo", "reward"):
        refs[objective] = tmp / f"ref_{objective}"
        Trainer(load_config(None, overrides(w, objective, refs[objective], 2 * B))).fit()
    return tmp, w, refs


@pytest.fixture(scope="module")
def setup(prepared):
    tmp, w, refs = prepared
    scenarios = {f"ddp_{o}": overrides(w, o, tmp / f"ddp_{o}", B, *DDP) for o in ("dpo", "reward", "rl")}
    # the GRPO run again, stopped after step 3's checkpoint and resumed on the same layout
    scenarios["ddp_rl_first_half"] = overrides(w, "rl", tmp / "ddp_rl_resumed", B, *DDP, "train.max_steps=3")
    results = launch(2, scenarios, tmp)
    (tmp / "resume").mkdir()
    resumed = overrides(w, "rl", tmp / "ddp_rl_resumed", B, *DDP)
    results.update(launch(2, {"ddp_rl_resumed": [*resumed, "--resume"]}, tmp / "resume"))
    return tmp, refs, results


@pytest.fixture(scope="module")
def mu2(prepared):
    """rl.iterations=2: step 3's checkpoint falls between the two updates of the second sampled batch.
    Launched on its own (the slow tier's test alone uses it)."""
    tmp, w, _ = prepared
    scenarios = {"ddp_rl_mu2": overrides(w, "rl", tmp / "ddp_rl_mu2", B, *DDP, *MU2),
                 "ddp_rl_mu2_first_half": overrides(w, "rl", tmp / "ddp_rl_mu2_resumed", B, *DDP, *MU2,
                                                    "train.max_steps=3")}
    (tmp / "mu2").mkdir()
    results = launch(2, scenarios, tmp / "mu2")
    (tmp / "mu2_resume").mkdir()
    resumed_mu2 = overrides(w, "rl", tmp / "ddp_rl_mu2_resumed", B, *DDP, *MU2)
    results.update(launch(2, {"ddp_rl_mu2_resumed": [*resumed_mu2, "--resume"]}, tmp / "mu2_resume"))
    return tmp, results


@pytest.mark.parametrize("objective", ["dpo", "reward"])
def test_two_ranks_equal_one_process(setup, objective):
    tmp, refs, results = setup
    name = f"ddp_{objective}"
    assert results[name] == "ok", results[name]
    ref, got = curve(refs[objective], COMPARED[objective]), curve(tmp / name, COMPARED[objective])
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert ref[step].keys() == got[step].keys(), step
        for k, v in ref[step].items():
            assert abs(v - got[step][k]) <= TOL * max(1.0, abs(v)), (step, k, v, got[step][k])
    ours, theirs = final_weights(tmp / name), final_weights(refs[objective])
    assert ours.keys() == theirs.keys()
    for k, v in theirs.items():
        assert (ours[k] - v).abs().max().item() <= PARAM_TOL, k


def test_grpo_on_two_ranks_trains_and_resumes_exactly(setup):
    tmp, _, results = setup
    assert results["ddp_rl"] == "ok", results["ddp_rl"]
    assert results["ddp_rl_resumed"] == "ok", results["ddp_rl_resumed"]
    keys = ("loss", "grad_norm", "reward", "kl", "completion_tokens", "val_reward")
    straight, resumed = curve(tmp / "ddp_rl", keys), curve(tmp / "ddp_rl_resumed", keys)
    assert sorted(straight) == list(range(1, STEPS + 1)) and "val_reward" in straight[STEPS]
    assert straight == resumed


# slow tier: a third and fourth launch of 2 ranks; the default tier resumes GRPO on 2 ranks above and
# between the two updates in one process (tests/integration/test_rl_iterations.py)
@pytest.mark.slow
def test_grpo_with_two_updates_per_batch_on_two_ranks_resumes_between_them(mu2):
    import torch

    tmp, results = mu2
    for name in ("ddp_rl_mu2", "ddp_rl_mu2_first_half", "ddp_rl_mu2_resumed"):
        assert results[name] == "ok", results[name]
    keys = ("loss", "grad_norm", "reward", "kl", "clip_fraction", "iteration")
    straight, resumed = curve(tmp / "ddp_rl_mu2", keys), curve(tmp / "ddp_rl_mu2_resumed", keys)
    assert [straight[s]["iteration"] for s in sorted(straight)] == [1.0, 2.0] * (STEPS // 2)
    assert straight == resumed
    ckpt = tmp / "ddp_rl_mu2_resumed" / "checkpoints" / "step_00000003"
    kept = [torch.load(ckpt / f"rank_{r:05d}.pt", weights_only=True)["states"]["replay"] for r in range(2)]
    # each rank kept its own sampled batch (2 micro-batches), one of its two updates done
    assert [(k["rank"], k["world_size"], k["uses"], len(k["batches"])) for k in kept] == [(0, 2, 1, 2),
                                                                                         (1, 2, 1, 2)]
    assert not torch.equal(kept[0]["batches"][0]["input_ids"], kept[1]["batches"][0]["input_ids"])
