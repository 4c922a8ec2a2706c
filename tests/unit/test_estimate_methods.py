"""`lmforge estimate` for the training methods beside pretraining (tools/estimate_methods.py,
estimate_adapters.py): what a frozen base with LoRA / QLoRA adapters, SFT's packed rows, preference
pairs and a reward model's score head save for backward equals autograd's saved tensors (exact); the
model states follow the method (no gradients or optimizer state for a frozen base, NF4 bytes, a DPO
reference copy); and what the estimate does not model is refused by name."""

from __future__ import annotations

import contextlib

import pytest
import torch

from lmforge.cli import main
from lmforge.config.schema import Config
from lmforge.data.batch import IGNORE_INDEX, ChatBatch, PreferenceBatch, TokenBatch
from lmforge.engine.objectives import SFT, CausalLM, Preference
from lmforge.engine.objectives.reward import RewardModel
from lmforge.errors import ConfigError
from lmforge.finetune.setup import apply_finetune
from lmforge.models.transformer import add_head, build_model
from lmforge.tools.estimate import estimate, resolve_layout
from lmforge.tools.estimate_methods import (
    dense_packed_mask,
    method_of,
    method_tensors,
    trainable_elements,
    weight_copies,
)
from lmforge.tools.estimate_parts import activation_profile, model_tensors

TINY = dict(d_model=64, n_layers=2, n_heads=4, vocab_size=300, max_seq_len=64)


def _cfg(model=None, train=None, finetune=None, objective="causal_lm", **sections) -> Config:
    return Config.model_validate({"model": {**TINY, **(model or {})}, "train": train or {},
                                  "finetune": finetune or {}, "objective": {"name": objective}, **sections})


def _estimated(cfg: Config, rows: int, T: int, precision: str) -> int:
    """Saved activations of one micro-batch of `rows` rows as the estimate counts them, plus the
    autocast weight copies (a row of their own in the estimate, saved tensors to autograd)."""
    method = method_of(cfg, resolve_layout(cfg, 1))
    held = method_tensors(model_tensors(cfg.model), cfg, method).tensors
    layers = list(range(cfg.model.n_layers))
    prof = activation_profile(cfg, rows, T, precision, "cpu", layers, True, True, packed=method.packed,
                              dense_mask=method.packed and dense_packed_mask(cfg, "cpu"),
                              adapters=method.adapters, head=method.head,
                              trainable=trainable_elements(held, layers, method))
    copies = weight_copies(held, prof) if precision == "bf16" else 0
    return prof.saved + copies


def _saved(cfg: Config, rows: int, T: int, precision: str) -> int:
    """Bytes of the distinct storages autograd saves for one training forward of the method."""
    torch.manual_seed(0)
    model = build_model(cfg.model)
    name = cfg.objective.name
    if name == "reward":
        add_head(model, "score")
    if cfg.finetune.method != "full":
        apply_finetune(model, cfg.finetune)
        if name == "reward":
            model.score.requires_grad_(True)  # as the assembly: the score head trains beside the adapters
    model.train()
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    g = torch.Generator().manual_seed(0)
    V = cfg.model.vocab_size
    x = torch.randint(0, V, (rows, T), generator=g)
    y = torch.randint(0, V, (rows, T), generator=g)
    if name in ("dpo", "reward"):
        y[:, -1] = IGNORE_INDEX  # a pair's completion ends its row
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    autocast = torch.autocast("cpu", torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        if name == "sft":
            seg = torch.zeros(rows, T, dtype=torch.long)
            seg[:, T // 2:] = 1
            pos = torch.cat([torch.arange(T // 2), torch.arange(T - T // 2)]).expand(rows, T)
            SFT(packing=True, target_rows=True)(model, ChatBatch(x, y, pos, seg))
        elif name == "dpo":
            Preference(loss="sigmoid")(model, PreferenceBatch(x, y, ref_logps=torch.zeros(rows)))
        elif name == "reward":
            RewardModel()(model, PreferenceBatch(x, y))
        else:
            CausalLM(cfg.train.loss_chunk_tokens)(model, TokenBatch(x, y))
    return sum(seen.values())


LORA, QLORA = {"method": "lora", "r": 4}, {"method": "qlora", "r": 4}
GPT2 = {"pos_embedding": "learned", "mlp": "gelu", "norm": "layernorm", "bias": True, "tie_embeddings": False}


@pytest.mark.parametrize("model,train,finetune,objective,precision", [
    ({}, {}, LORA, "causal_lm", "fp32"),
    ({}, {}, LORA, "causal_lm", "bf16"),
    ({}, {}, QLORA, "causal_lm", "fp32"),
    ({}, {}, QLORA, "causal_lm", "bf16"),
    ({}, {}, {**LORA, "targets": ["q_proj", "v_proj"]}, "causal_lm", "fp32"),
    ({}, {}, {**LORA, "targets": ["q_proj", "v_proj"]}, "causal_lm", "bf16"),
    ({}, {}, {**LORA, "targets": ["down_proj"]}, "causal_lm", "fp32"),
    ({}, {}, {**LORA, "targets": ["layers.1.attn.wo"]}, "causal_lm", "fp32"),
    ({}, {}, {**LORA, "dropout": 0.1}, "causal_lm", "fp32"),
    ({}, {}, {**LORA, "dropout": 0.1}, "causal_lm", "bf16"),
    ({}, {}, {**LORA, "train_tokens": [1, 2, 3]}, "causal_lm", "fp32"),
    ({"tie_embeddings": False}, {}, {**LORA, "train_tokens": [5]}, "causal_lm", "fp32"),
    ({}, {}, {**LORA, "train_tokens": [1, 2, 3]}, "causal_lm", "bf16"),
    (GPT2, {}, LORA, "causal_lm", "fp32"),
    (GPT2, {}, QLORA, "causal_lm", "bf16"),
    ({"n_kv_heads": 2, "sliding_window": 16}, {}, LORA, "causal_lm", "fp32"),
    ({}, {"loss_chunk_tokens": 16}, LORA, "causal_lm", "fp32"),
    ({}, {}, {"method": "full"}, "sft", "fp32"),
    ({}, {}, LORA, "sft", "fp32"),
    ({}, {}, {"method": "full"}, "dpo", "fp32"),
    ({}, {}, {"method": "full"}, "dpo", "bf16"),
    ({}, {}, LORA, "dpo", "fp32"),
    ({}, {}, QLORA, "dpo", "bf16"),
    ({}, {}, {"method": "full"}, "reward", "fp32"),
    ({}, {}, {"method": "full"}, "reward", "bf16"),
    ({}, {}, LORA, "reward", "fp32"),
])
def test_saved_activations_match_autograd(model, train, finetune, objective, precision):
    cfg = _cfg(model, {"precision": precision, **train}, finetune, objective)
    assert _estimated(cfg, 4, 32, precision) == _saved(cfg, 4, 32, precision)  # exact, to the byte


def _trained(cfg: Config, rows: int, T: int):
    """A model set up as the method trains it after one optimizer step: (model, optimizer)."""
    from lmforge.optim.builder import build_optimizer

    torch.manual_seed(0)
    model = build_model(cfg.model)
    if cfg.objective.name == "reward":
        add_head(model, "score")
    if cfg.finetune.method != "full":
        apply_finetune(model, cfg.finetune)
        if cfg.objective.name == "reward":
            model.score.requires_grad_(True)
    opt = build_optimizer(model, cfg.optim)
    x = torch.randint(0, cfg.model.vocab_size, (rows, T))
    y = x.clone()
    y[:, -1] = IGNORE_INDEX
    if cfg.objective.name == "reward":
        out = RewardModel()(model, PreferenceBatch(x, y))
    else:
        out = CausalLM()(model, TokenBatch(x, y))
    out.loss.backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("finetune,objective", [
    (LORA, "causal_lm"), (QLORA, "causal_lm"), ({**LORA, "train_tokens": [3, 4]}, "sft"),
    ({**LORA, "targets": ["q_proj", "layers.1.mlp.w_down"]}, "causal_lm"), ({"method": "full"}, "reward"),
    (QLORA, "reward"),
])
def test_model_states_follow_the_method(finetune, objective):
    """Parameters (NF4 bytes, adapters, trained token rows), gradients and optimizer state (only what
    trains) as the real model holds them after a step."""
    cfg = _cfg({"tie_embeddings": False} if objective == "reward" else {}, {"precision": "fp32"}, finetune,
               objective)
    est = estimate(cfg)
    model, opt = _trained(cfg, 2, 16)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    params += sum(b.nbytes for name, b in model.named_buffers() if not name.startswith("rope_"))
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    state = sum(v.nbytes for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    assert next(v for k, v in est.rows.items() if k.startswith("parameters")) == params
    assert est.rows["gradients (fp32)"] == grads
    assert est.rows["optimizer state"] == state
    if finetune["method"] != "full":
        assert grads < sum(t.numel for t in model_tensors(cfg.model).tensors) * 4 / 10  # the base takes none


def test_qlora_load_holds_the_fp32_base_and_its_nf4_copy():
    cfg = _cfg(finetune=QLORA, train={"precision": "fp32"})
    est = estimate(cfg)
    fp32 = sum(t.numel for t in model_tensors(cfg.model).tensors) * 4
    assert est.moments["model load (fp32 weights before NF4)"] > fp32  # quantize_model_nf4 keeps both
    assert est.rows["parameters (NF4 block linears, fp32 rest)"] < fp32


def test_dpo_counts_pairs_and_the_reference_model():
    full = _cfg(objective="dpo", train={"precision": "fp32", "micro_batch_size": 4})
    lm = estimate(_cfg(train={"precision": "fp32", "micro_batch_size": 8}))
    est = estimate(full)
    copy = sum(t.numel for t in model_tensors(full.model).tensors) * 4
    assert est.rows["reference model (frozen copy, fp32)"] == copy
    # 4 pairs are 8 rows: the activations of 8 sequences, beside the frozen copy
    assert est.rows["activations (saved for backward)"] >= lm.rows["activations (saved for backward)"]
    assert est.peak >= lm.peak + copy
    assert "reference forward (no gradients)" in est.moments
    ahead = estimate(_cfg(objective="dpo", train={"precision": "fp32", "micro_batch_size": 4},
                          preference={"precompute_reference": True}))
    assert "reference model (frozen copy, fp32)" not in ahead.rows
    assert "reference log-probs computed ahead (before training)" in ahead.moments
    lora = estimate(_cfg(objective="dpo", finetune=LORA, train={"precision": "fp32", "micro_batch_size": 4}))
    assert "reference model (frozen copy, fp32)" not in lora.rows  # the base with its adapters off
    assert "reference forward (no gradients)" in lora.moments
    free = estimate(_cfg(objective="dpo", train={"precision": "fp32", "micro_batch_size": 4},
                         preference={"loss": "simpo"}))
    assert not any("reference" in k for k in [*free.rows, *free.moments])


def test_fine_tuning_is_not_estimated_as_pretraining():
    """The finding: LoRA, QLoRA and DPO got the pretraining peak."""
    base = estimate(_cfg(train={"precision": "fp32"})).peak
    for finetune, objective in ((LORA, "sft"), (QLORA, "sft"), ({"method": "full"}, "dpo")):
        est = estimate(_cfg(train={"precision": "fp32"}, finetune=finetune, objective=objective))
        assert est.peak != base


@pytest.mark.parametrize("config,world_size,needle", [
    ({"objective": {"name": "rl"}}, 1, "objective rl"),
    ({"objective": {"name": "distill"}}, 1, "objective distill"),
    ({"finetune": {"method": "dora"}}, 1, "finetune.method=dora"),
    ({"finetune": {"method": "lora"}}, 2, "lora is modelled by lmforge estimate on one process"),
    ({"finetune": {"method": "qlora"}, "model": {"moe": {"n_experts": 4}}}, 1, "mixture of experts"),
    ({"finetune": {"method": "lora", "targets": ["lm_head"]}, "model": {"tie_embeddings": False}}, 1,
     "output or score head"),
    ({"finetune": {"method": "lora"}, "model": {"dropout": 0.1}}, 1, "model.dropout"),
    ({"objective": {"name": "dpo"}}, 2, "frozen copy of the model as its reference"),
    ({"objective": {"name": "dpo"}, "preference": {"loss": "kto", "precompute_reference": True}}, 1,
     "precompute_reference does not apply to loss kto"),
    ({"objective": {"name": "sft"}, "parallel": {"pp": 2, "dp_shard": 1}, "train": {"grad_accum_steps": 2}},
     2, "objective sft has no per-stage"),
    ({"objective": {"name": "dpo"}, "train": {"loss_chunk_tokens": 64}}, 1, "loss_chunk_tokens"),
])
def test_what_is_not_modelled_is_refused_by_name(config, world_size, needle):
    data = {"model": {**TINY, **config.pop("model", {})}, **config}
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        estimate(Config.model_validate(data), world_size)


def test_cli_refuses_rl_with_one_line(capsys):
    rc = main(["estimate", "--set", "model.vocab_size=300", "--set", "objective.name=rl"])
    err = capsys.readouterr().err
    assert rc == 2 and "lmforge estimate: error: objective rl" in err and "Traceback" not in err


@pytest.mark.parametrize("sets,needle", [
    (["model.n_layers=5000"], "model.n_layers=5,000"),
    (["parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_microbatches=100000"], "parallel.pp_microbatches"),
    ([f"model.vocab_size={10**30}"], "model.vocab_size=1,000,000"),
    ([f"train.micro_batch_size={10**400}"], "train.micro_batch_size="),
    ([f"model.moe.n_experts={1 << 31}", f"model.moe.d_ff_expert={1 << 31}"], "tensors torch cannot hold"),
])
def test_counts_beyond_the_bounds_are_refused(sets, needle, capsys):
    world = "2" if "parallel.pp=2" in sets else "1"
    argv = ["estimate", "--set", "model.vocab_size=300", "--world-size", world, "--device-memory", "80"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_deep_models_and_huge_world_sizes_are_arithmetic():
    """The estimate builds one block (never the model) and walks ZeRO-1's owners and a pipeline's
    operations with constant work each: the bounds' largest cases return."""
    deep = _cfg({"n_layers": 4096}, {"precision": "fp32"})
    assert len(model_tensors(deep.model).tensors) == 4096 * 9 + 2
    assert estimate(deep).peak > 0
    zero1 = _cfg(parallel={"zero": 1}, train={"precision": "fp32"})
    assert estimate(zero1, 1 << 20).peak > 0
    pipe = _cfg({"n_layers": 4}, {"precision": "fp32", "grad_accum_steps": 1 << 15, "micro_batch_size": 1},
                parallel={"pp": 2, "dp_shard": 1, "pp_schedule": "gpipe"})
    assert estimate(pipe, 2).peak > 0
