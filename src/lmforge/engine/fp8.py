"""train.fp8: FP8 training of the model's Linear layers through torchao's float8 (the recipes
"tensorwise" and "rowwise" of Float8LinearConfig.from_recipe_name), under bf16 autocast.

What is converted: every nn.Linear of the transformer blocks whose in- and out-features are multiples of
16 (the FP8 GEMM's rule; torchao's own filter). Not converted, and kept in bf16: the embedding and the
output head (not nn.Linear in lmforge; FP8 there costs the most accuracy, as torchtitan also leaves it),
grouped MoE experts, and any Linear with another shape (named in the line the run prints). The weights
stay high-precision parameters with the nn.Linear names (Float8Linear subclasses nn.Linear and casts on
the fly): checkpoints, resume without fp8 and HF export are unchanged.

Where it runs: CUDA GPUs of compute capability 8.9 or later (Ada, Hopper, Blackwell) with bf16 precision;
refused elsewhere before any work. torch.compile fuses the casts into the GEMMs: without train.compile
fp8 is correct but usually slower than bf16 (the run says so). With FSDP the weights are all-gathered
in bf16 and cast after the gather (torchao's float8 all-gather is not used). Tensor parallelism needs
torchao's float8 TP plans and adapters wrap the Linear layers: both are refused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lmforge.errors import ConfigError

# Tests run the real conversion on a CPU with torchao's emulation (FP8 rounding in plain matmuls): the
# device checks are skipped and the recipe's `emulate` is set. Not a config key.
EMULATE_FOR_TESTS = False


def check_fp8(cfg, device: torch.device) -> None:
    """Refuse, before any work, what train.fp8 cannot run on."""
    recipe = cfg.train.fp8
    if recipe == "none":
        return
    where = f"train.fp8={recipe}"
    if not EMULATE_FOR_TESTS:
        if device.type != "cuda":
            raise ConfigError(f"{where}: FP8 training needs a CUDA GPU of compute capability 8.9 or later "
                              f"(Ada, Hopper, Blackwell); this run's device is {device.type}. "
                              "Set train.fp8=none")
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ConfigError(f"{where}: this GPU ({torch.cuda.get_device_name(device)}) has compute "
                              f"capability {major}.{minor}; FP8 matmuls need 8.9 or later. Set "
                              "train.fp8=none (bf16 runs at full speed there)")
    if cfg.train.precision not in ("bf16", "auto"):
        raise ConfigError(f"{where} computes the non-FP8 parts under bf16 autocast; train.precision="
                          f"{cfg.train.precision} cannot run it: set train.precision=bf16 (or auto)")
    if cfg.finetune.method != "full":
        raise ConfigError(f"{where} converts the model's Linear layers, which finetune.method="
                          f"{cfg.finetune.method} wraps with adapters: set train.fp8=none for adapter "
                          "training")
    if cfg.parallel.tp > 1:
        raise ConfigError(f"{where} with tensor parallelism (parallel.tp={cfg.parallel.tp}) needs torchao's "
                          "float8 TP plans, which lmforge does not wire: use FSDP/DDP, or train.fp8=none")
    if cfg.train.master_weights != "off":
        raise ConfigError(f"{where} keeps the weights high-precision itself; set train.master_weights=off")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ConfigError(f"{where} needs torchao (pip install torchao)") from None


def _convertible(module: nn.Module, fqn: str) -> bool:
    return (type(module) is nn.Linear and fqn.startswith("layers.")
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert_fp8(model: nn.Module, cfg, precision: str, say: Callable[[str], object]) -> None:
    """Swap the convertible Linear layers of `model` for torchao's Float8Linear (in place)."""
    recipe = cfg.train.fp8
    if recipe == "none":
        return
    if precision != "bf16":
        raise ConfigError(f"train.fp8={recipe}: train.precision resolved to {precision}; FP8 training runs "
                          "under bf16 autocast: set train.precision=bf16")
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if EMULATE_FOR_TESTS:
        config = dataclasses.replace(config, emulate=True)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    chosen = [n for n, m in linears.items() if _convertible(m, n)]
    if not chosen:
        raise ConfigError(f"train.fp8={recipe}: no Linear layer of this model has both dimensions a multiple "
                          "of 16 (the FP8 GEMM's rule); set train.fp8=none")
    convert_to_float8_training(model, config=config, module_filter_fn=_convertible)
    skipped = sorted(set(linears) - set(chosen))
    note = f"; kept in bf16: {', '.join(skipped[:4])}{' ...' if len(skipped) > 4 else ''}" if skipped else ""
    slow = "" if cfg.train.compile else " (without train.compile the casts are not fused: usually slower)"
    say(f"fp8 ({recipe}): {len(chosen)} Linear layers train in FP8{note}{slow}")
