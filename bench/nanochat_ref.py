"""nanochat as a benchmark baseline: found in a checkout the user provides, never copied into this repo.

PyPI's `nanochat` (0.1.1, 0.1.2) is only the `rustbpe` tokenizer (a 16 kB Rust sdist built with maturin,
which fetches crates from crates.io at install time; no model code), so the benches take a path to a
clone of https://github.com/karpathy/nanochat (`--nanochat PATH` or the environment variable
LMFORGE_NANOCHAT) and import its `nanochat` package from there. That is the user's own code, run as
they asked. What lives here: finding and loading the checkout (fp32 compute through its own switch,
NANOCHAT_DTYPE), lmforge's closest model config, nanochat's GPT and optimizer built the way its
scripts/base_train.py builds them for one process, and one iteration of base_train.py's loop.

The two models are not the same function (nanochat: relu^2 MLP, weightless RMSNorm, norm after the
embedding, value embeddings on alternate layers, smear / backout / per-layer residual scalars, logit
softcap 15), so there is no weight copy: the row compares each tool's own model at a shared shape.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from lmforge.config.schema import ModelConfig
from lmforge.engine.loss import token_loss_sum
from lmforge.models.flops import count_params

ENV = "LMFORGE_NANOCHAT"
HOW_TO_GET = (
    "nanochat's model is not on PyPI (the `nanochat` package there is only its rustbpe tokenizer): clone "
    f"it (`git clone https://github.com/karpathy/nanochat`) and pass --nanochat PATH/TO/nanochat or set "
    f"{ENV}=PATH/TO/nanochat"
)
# base_train.py's optimizer flags (its CLI defaults) and its reference batch of 2**19 tokens, against
# which it scales every lr by sqrt(tokens per step / 2**19).
BASE_TRAIN_LRS = dict(unembedding_lr=0.008, embedding_lr=0.3, scalar_lr=0.5, matrix_lr=0.02)
BASE_TRAIN_WEIGHT_DECAY = 0.28
B_REF = 2**19


def find_nanochat(path: str | os.PathLike | None = None) -> tuple[Path | None, str]:
    """(the checkout, "") when `path` (else $LMFORGE_NANOCHAT) is a directory holding nanochat's
    nanochat/gpt.py and nanochat/optim.py, else (None, why not and how to get one)."""
    given = path if path is not None else os.environ.get(ENV)
    if not given:
        return None, f"no nanochat checkout given. {HOW_TO_GET}"
    root = Path(given).expanduser().resolve()
    for part in ("gpt.py", "optim.py", "common.py"):
        if not (root / "nanochat" / part).is_file():
            return None, f"{root} has no nanochat/{part} (is it a nanochat checkout?). {HOW_TO_GET}"
    return root, ""


def load_nanochat(root: Path) -> ModuleType:
    """nanochat's `nanochat.gpt` from checkout `root`, its compute dtype fp32.

    Its modules import each other as the package `nanochat`, so the checkout goes on sys.path (one
    checkout per process). COMPUTE_DTYPE is read once, at import, from NANOCHAT_DTYPE (its documented
    override; without CUDA it already picks fp32): set to float32 for the import. Importing
    nanochat.common also calls logging.basicConfig on the root logger; the bench's own logging is
    restored afterwards."""
    root = root.resolve()
    loaded = sys.modules.get("nanochat")
    if loaded is not None:
        where = Path(getattr(loaded, "__file__", "") or "").resolve().parent.parent
        if where != root:
            raise ValueError(f"nanochat is already imported from {where}; one checkout per process, "
                             f"not also {root}")
    saved_env = os.environ.get("NANOCHAT_DTYPE")
    os.environ["NANOCHAT_DTYPE"] = "float32"
    log = logging.getLogger()
    saved_log = (list(log.handlers), log.level)
    sys.path.insert(0, str(root))
    try:
        import nanochat.common as common
        import nanochat.gpt as gpt
    except ModuleNotFoundError as e:
        raise ValueError(f"nanochat ({root}) imports {e.name!r}, which is not installed here: "
                         f"`pip install {e.name}` (nanochat's own dependency, not lmforge's)") from e
    finally:
        sys.path.remove(str(root))
        log.handlers[:], log.level = saved_log
        if saved_env is None:
            del os.environ["NANOCHAT_DTYPE"]
        else:
            os.environ["NANOCHAT_DTYPE"] = saved_env
    if Path(gpt.__file__).resolve().parent.parent != root:
        raise ValueError(f"imported nanochat.gpt from {gpt.__file__}, not from {root}")
    if common.COMPUTE_DTYPE != torch.float32:
        raise ValueError(f"nanochat computes in {common.COMPUTE_DTYPE} ({common.COMPUTE_DTYPE_REASON}); the "
                         "bench is fp32: run it in a fresh process")
    for attr in ("GPT", "GPTConfig"):
        if not hasattr(gpt, attr):
            raise ValueError(f"{gpt.__file__} defines no {attr}: not nanochat's gpt.py. {HOW_TO_GET}")
    return gpt


def lmforge_config(n_layers: int, n_heads: int, d_model: int, seq_len: int, vocab: int) -> ModelConfig:
    """lmforge's closest model to nanochat's GPT: RoPE (nanochat's base 1e5), RMSNorm, QK norm, untied,
    no biases, and a GELU MLP of 4 * d_model: the same two matmul shapes as nanochat's 4x relu^2 MLP,
    so the same matmul FLOPs and the same matrices for Muon to orthogonalise (a SwiGLU of equal
    parameters needs d_ff = 8/3 d_model, not an integer here, and a third matrix)."""
    return ModelConfig(
        vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads,
        d_ff=4 * d_model, max_seq_len=seq_len, norm="rmsnorm", pos_embedding="rope", rope_theta=100000.0,
        mlp="gelu", qk_norm=True, bias=False, tie_embeddings=False, dropout=0.0,
    )


def build_nanochat(gpt: ModuleType, cfg: ModelConfig, device: torch.device) -> torch.nn.Module:
    """nanochat's GPT of `cfg`'s shape as base_train.py builds it (on the meta device, then to_empty and
    init_weights), window_pattern "L" (full causal attention in every layer), in training mode."""
    ncfg = gpt.GPTConfig(sequence_len=cfg.max_seq_len, vocab_size=cfg.vocab_size, n_layer=cfg.n_layers,
                         n_head=cfg.n_heads, n_kv_head=cfg.resolved_kv_heads, n_embd=cfg.d_model,
                         window_pattern="L")
    with contextlib.redirect_stdout(io.StringIO()), torch.device("meta"):
        model = gpt.GPT(ncfg)  # prints a note when it pads the vocab
    model.to_empty(device=device)
    model.init_weights()
    return model.train()


def nanochat_optimizer(model: torch.nn.Module, tokens_per_step: int) -> torch.optim.Optimizer:
    """nanochat's MuonAdamW from its GPT.setup_optimizer with base_train.py's default lrs scaled by its
    sqrt(batch / 2**19) rule. Weight decay: its default 0.28 without the depth-dependent rescaling
    (which needs a d12 reference model); the values change no work, its fused steps apply every term."""
    scale = (tokens_per_step / B_REF) ** 0.5
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its lr scaling
        return model.setup_optimizer(**{k: v * scale for k, v in BASE_TRAIN_LRS.items()},
                                     weight_decay=BASE_TRAIN_WEIGHT_DECAY)


def initial_losses(ours: torch.nn.Module, nano: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Both models' fp32 loss on batch (x, y) before training. They are different functions, so the
    check is that each is a mean token cross-entropy over the vocabulary at init: within 0.5 of
    ln(vocab) (nanochat's head starts at std 1e-3, lmforge's at 0.02)."""
    with torch.no_grad():
        logits = ours(x)
        loss_ours = float(token_loss_sum(logits, y) / y.numel())
        loss_nano = float(nano(x, y))
    res = dict(loss_lmforge=loss_ours, loss_nanochat=loss_nano, ln_vocab=math.log(logits.size(-1)))
    assert all(abs(v - res["ln_vocab"]) < 0.5 for v in (loss_ours, loss_nano)), res
    return res


def nanochat_stepper(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     batches: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[int], torch.Tensor]:
    """One iteration of base_train.py's loop with one micro-step (grad_accum_steps = 1): loss =
    model(x, y), loss / 1, backward; each group's lr (initial_lr x the schedule's multiplier, here its
    constant middle, 1.0) and the Muon groups' momentum and weight decay set; optimizer.step();
    model.zero_grad(set_to_none=True). It clips no gradients. Left out: its data loader, logging, and
    its gc.freeze / gc.disable after the first step (process-wide, it would change the other side
    too). `model` is the GPT, or torch.compile(GPT, dynamic=False) as base_train.py runs it. Returns
    the detached loss (base_train.py reads it with .item() every step; the bench's float() does)."""
    muon = [g for g in optimizer.param_groups if g["kind"] == "muon"]
    momentum, weight_decay = muon[0]["momentum"], muon[0]["weight_decay"]

    def step(i: int) -> torch.Tensor:
        x, y = batches[i % len(batches)]
        loss = model(x, y)
        train_loss = loss.detach()
        (loss / 1).backward()
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * 1.0
            if group["kind"] == "muon":
                group["momentum"] = momentum
                group["weight_decay"] = weight_decay
        optimizer.step()
        model.zero_grad(set_to_none=True)
        return train_loss

    return step


def bench_shape(name: str, s: dict, args, bench: ModuleType) -> dict:
    """train_throughput.py's `nanochat` row: lmforge's closest model with optim.name=muon (its train step,
    clip 1.0) vs nanochat's own GPT, MuonAdamW and base_train.py step, fp32 on CPU, interleaved; with
    --compile both compiled. `bench` is train_throughput (its assemble / stepper / interleave /
    summarise helpers; passed in, since it imports this file). {"skipped": why} without a checkout."""
    root, why = find_nanochat(args.nanochat)
    if root is None:
        print(f"[{name}] skipped: {why}", flush=True)
        return dict(skipped=why)
    gpt = load_nanochat(root)
    cfg = lmforge_config(s["n_layers"], s["n_heads"], s["d_model"], s["seq_len"], s["vocab"])
    B, T = s["batch"], s["seq_len"]
    rounds, budget_s, warmup = bench.rounds_of(s, args)
    data, batches = bench.batches_of(cfg.vocab_size, B, T)
    cpu, muon = torch.device("cpu"), {"name": "muon"}  # lmforge's Muon defaults, as `lmforge train` has them

    run = bench.assemble(cfg, data, optim=muon)
    torch.manual_seed(0)
    nano = build_nanochat(gpt, cfg, cpu)
    params = {"lmforge": sum(p.numel() for p in run.model.parameters()),
              "nanochat": sum(p.numel() for p in nano.parameters())}
    assert params["lmforge"] == count_params(cfg)
    check = initial_losses(run.model, nano, *batches[0])
    n_ours, n_nano = params["lmforge"], params["nanochat"]
    print(f"[{name}] nanochat from {root}; params lmforge {n_ours:,}, nanochat {n_nano:,} "
          f"({n_nano / n_ours - 1:+.1%}); initial loss lmforge {check['loss_lmforge']:.4f}, "
          f"nanochat {check['loss_nanochat']:.4f} (ln V {check['ln_vocab']:.4f})", flush=True)

    sides = {"lmforge": bench.stepper(run, batches),
             "nanochat": nanochat_stepper(nano, nanochat_optimizer(nano, B * T), batches)}
    if args.compile:  # built before any step, from the same initial weights
        run_c = bench.assemble(cfg, data, compile=True, optim=muon)
        run_c.model.load_state_dict(run.model.state_dict())
        nano_c = build_nanochat(gpt, cfg, cpu)
        nano_c.load_state_dict(nano.state_dict())
        sides["lmforge_compile"] = bench.stepper(run_c, batches)
        # base_train.py: torch.compile(model, dynamic=False), then setup_optimizer on it
        nano_c = torch.compile(nano_c, dynamic=False)
        sides["nanochat_compile"] = nanochat_stepper(nano_c, nanochat_optimizer(nano_c, B * T), batches)
    # nanochat's fused optimizer steps are torch.compile'd functions in every mode: its first eager step
    # compiles them (inductor's on-disk cache makes later processes faster).
    compile_s = {k: bench.first_step_s(sides[k]) for k in ("nanochat", "lmforge_compile", "nanochat_compile")
                 if k in sides}
    print(f"[{name}] first steps (compiles): " + ", ".join(f"{k} {v:.1f} s" for k, v in compile_s.items()),
          flush=True)

    timing = bench.interleave(sides, warmup, rounds, budget_s, args.peak_n)
    res = bench.summarise(cfg, B, T, params["lmforge"], warmup, timing, nanochat_checkout=str(root),
                          params_per_side=params, initial_loss_check=check)
    res["compile_s"] = compile_s
    bench.add_ratios(res, "nanochat", "nanochat_compile", timing["times"])
    return res
