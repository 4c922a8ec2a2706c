"""Fine-tuning on 2 real gloo ranks trains the single-process curve: `objective sft` through the whole
Trainer (ChatLoader rank slices, packed rows of uneven target counts, validation, checkpoints) under
DDP (parallel.dp_replicate=2) and FSDP (parallel.dp_shard=2), full fine-tuning and LoRA, equals one
process on the same global batch (micro_batch_size doubled, the same accumulation).

One worker start-up serves every scenario: this file, run as a script by `launch`, joins one process
group and trains each scenario's Trainer in turn (importing torch costs seconds per process).

Tolerance: test_train_torchrun's, for the same layouts of the same Trainer: every logged value within
1e-5 (relative above 1), final weights within 1e-6. fp32; only the order of float sums differs."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import pytest
from dist_harness import SRC, run_ranks

# Slow tier (CI runs it): ~25 s of launches; DDP/FSDP stay in the default tier (test_two_ranks.py), SFT in
# one process (tests/integration/test_sft.py).
pytestmark = pytest.mark.slow

STEPS = 6
COMPARED = ("loss", "grad_norm", "lr", "val_loss", "val_bpb")
TOL, PARAM_TOL = 1e-5, 1e-6
B = 2  # rows per rank per micro-batch; the single process takes 2 * B

DDP, FSDP = ("parallel.dp_replicate=2", "parallel.dp_shard=1"), ("parallel.dp_shard=2",)
# The single-process references, by the settings they share with the layouts below.
REFS = {
    "full": (),
    "lora": ("finetune.method=lora", "finetune.r=4"),  # ChatML's new tokens: their rows train too
    # FSDP shards the token table, which trainable token rows need whole: a template of known tokens.
    "lora_plain": ("finetune.method=lora", "finetune.r=4", "sft.template={plain}"),
    # One conversation per row, padded to the longest of the rank's rows: each rank pads differently.
    "full_unpacked": ("sft.packing=false",),
}
SCENARIOS = {  # name: (reference, layout)
    "ddp_full": ("full", DDP),
    "ddp_lora": ("lora", DDP),
    "fsdp_full": ("full", FSDP),
    "fsdp_lora": ("lora_plain", FSDP),
    "ddp_full_unpacked": ("full_unpacked", DDP),
}


def overrides(base: Path, chat: Path, run_dir: Path, rows: int, *extra: str) -> list[str]:
    return [
        "objective.name=sft", f"model.init_from={base}", f"sft.data=[{chat}]", "sft.val_fraction=0.15",
        f"run.dir={run_dir}", f"train.max_steps={STEPS}", f"train.micro_batch_size={rows}",
        "train.grad_accum_steps=2", "train.precision=fp32", "train.threads=1", "train.log_every=1",
        "train.eval_every=3", "train.eval_batches=2", "checkpoint.every=3", "optim.lr=1e-3",
        "schedule.warmup_steps=2", "logging.progress=none", "parallel.timeout_s=120", *extra,
    ]


def curve(run_dir: Path, keys: tuple[str, ...] = COMPARED) -> dict[int, dict]:
    from lmforge.metrics.loggers import read_metrics

    out: dict[int, dict] = {}
    for r in read_metrics(run_dir / "metrics.jsonl"):
        if "event" not in r:
            out.setdefault(r["step"], {}).update({k: r[k] for k in keys if k in r})
    return out


def assert_same_curve(ref: dict, got: dict) -> None:
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert ref[step].keys() == got[step].keys(), step
        for k, v in ref[step].items():
            assert abs(v - got[step][k]) <= TOL * max(1.0, abs(v)), (step, k, v, got[step][k])


def final_weights(run_dir: Path) -> dict:
    from lmforge.checkpoint.runs import run_config
    from lmforge.finetune.setup import load_finetuned

    cfg, source = run_config(run_dir, [])
    return load_finetuned(cfg, source)[0].state_dict()


def launch(n: int, scenarios: dict[str, list[str]], tmp: Path, timeout: float = 300) -> dict[str, str]:
    """n ranks of this file as a worker, each training every scenario in turn; {name: "ok" or error}."""
    spec = tmp / "scenarios.json"
    spec.write_text(json.dumps(scenarios))
    env = {"OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    run_ranks(n, [sys.executable, __file__, str(spec), str(tmp)], tmp, env, timeout)
    per_rank = [json.loads((tmp / f"result_{r}.json").read_text()) for r in range(n)]
    return {name: next((res[name] for res in per_rank if res[name] != "ok"), "ok") for name in scenarios}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shared_data_dir):
    from conftest import TINY, tiny_overrides
    from lmforge.config import load_config
    from lmforge.data.instruct_tasks import generate, write_jsonl
    from lmforge.train.trainer import Trainer, train

    tmp = tmp_path_factory.mktemp("sft_dist")
    base, chat = tmp / "base", tmp / "chat.jsonl"
    train(load_config(TINY, tiny_overrides(base, shared_data_dir, "train.max_steps=8", "checkpoint.every=0",
                                           "train.eval_every=0")))
    write_jsonl(generate(None, 400, seed=1), chat)
    plain = tmp / "plain.jinja"  # roles as text, replies end with the tokenizer's own EOS
    plain.write_text("{% for m in messages %}{{ m['role'] + ': ' }}{% if m['role'] == 'assistant' %}"
                     "{% generation %}{{ m['content'] + eos_token }}{% endgeneration %}\n{% else %}"
                     "{{ m['content'] + '\n' }}{% endif %}{% endfor %}")
    extras = {ref: tuple(e.format(plain=plain) for e in extra) for ref, extra in REFS.items()}
    refs = {}
    for ref, extra in extras.items():
        refs[ref] = tmp / f"ref_{ref}"
        Trainer(load_config(None, overrides(base, chat, refs[ref], 2 * B, *extra))).fit()
    scenarios = {name: overrides(base, chat, tmp / name, B, *extras[ref], *layout)
                 for name, (ref, layout) in SCENARIOS.items()}
    return tmp, refs, launch(2, scenarios, tmp)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_sft_on_two_ranks_equals_one_process(setup, name):
    tmp, refs, results = setup
    assert results[name] == "ok", results[name]
    ref = refs[SCENARIOS[name][0]]
    assert_same_curve(curve(ref), curve(tmp / name))
    ours, theirs = final_weights(tmp / name), final_weights(ref)
    assert ours.keys() == theirs.keys()
    for k, v in theirs.items():
        assert (ours[k] - v).abs().max().item() <= PARAM_TOL, k


@pytest.mark.parametrize("name", ["ddp_full", "fsdp_lora", "ddp_full_unpacked"])
def test_tokens_seen_counts_the_whole_job(setup, name):
    """tokens_seen (the clock of a schedule in tokens and of the batch ramp) is the job's count of
    real (not padding) tokens: the same integers as one process on the same global batch."""
    tmp, refs, results = setup
    assert results[name] == "ok", results[name]
    ref, got = curve(refs[SCENARIOS[name][0]], ("tokens_seen",)), curve(tmp / name, ("tokens_seen",))
    assert [r["tokens_seen"] for r in got.values()] == [r["tokens_seen"] for r in ref.values()]


# ---- worker side ------------------------------------------------------------------------------
def _worker(spec_file: str, out_dir: str) -> None:
    from lmforge.config import load_config
    from lmforge.parallel.process_group import shutdown
    from lmforge.parallel.world import World
    from lmforge.train.trainer import Trainer

    results = {}
    for name, ovr in json.loads(Path(spec_file).read_text()).items():
        try:  # "--resume" among the overrides: continue the run in its run.dir
            Trainer(load_config(None, [o for o in ovr if o != "--resume"]), resume="--resume" in ovr).fit()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    (Path(out_dir) / f"result_{World.from_env().rank}.json").write_text(json.dumps(results))
    shutdown()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
