"""Fine-tuned runs out: `lmforge export` (merged weights as a Hugging Face model, with the chat
template), `lmforge export --adapter` (a PEFT adapter dir plus the exact base it was trained on) and
`lmforge merge` (an lmforge run with the adapters folded in, to evaluate, sample or train further).

Everything is read and checked before the output dir is touched; the output is built beside it and
swapped in at the end (`write_output_dir`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from lmforge.checkpoint.hf_io import export_hf, write_output_dir
from lmforge.checkpoint.manager import CheckpointManager
from lmforge.checkpoint.runs import check_rebuildable, is_hf_dir, run_config, run_tokenizer_file
from lmforge.config.load import save_config
from lmforge.config.methods import method_facts
from lmforge.data import Tokenizer, data_dir
from lmforge.data.chat_template import ChatTemplate
from lmforge.errors import LmforgeError
from lmforge.finetune.lora import lora_layers
from lmforge.finetune.peft_io import save_peft_adapter
from lmforge.finetune.setup import check_adapter_run, load_finetuned, load_merged, merged


def run_template(cfg) -> ChatTemplate | None:
    """The chat template a fine-tuned run was trained with (None for a pretraining run)."""
    if not method_facts(cfg).chat:
        return None
    from lmforge.data.sft import load_prepared_sft

    return load_prepared_sft(data_dir(cfg)).template


def export_run(
    src: str | Path,
    out: str | Path,
    overwrite: bool = False,
    max_shard_size: int = 5 * 2**30,
    weights: str = "model",
    say=print,
) -> Path:
    """A run as a Hugging Face model dir; a fine-tuned run's adapters are merged and its template kept."""
    if is_hf_dir(Path(src)):
        return export_hf(src, out, overwrite, max_shard_size, say, weights)
    cfg, _ = run_config(src)
    template = run_template(cfg)
    if cfg.model.quant is not None:
        say(f"note: {src} is quantized (int{cfg.model.quant.bits}); it is exported with its weights "
            "dequantized (the values the quantized model computes with) in the standard layout, which "
            "transformers loads without a quantization package; the files are full size")
    written = export_hf(
        src,
        out,
        overwrite,
        max_shard_size,
        say,
        weights,
        load=load_merged,
        chat_template=None if template is None else template.source,
        end_of_turn=None if template is None else template.end_of_turn,
    )
    if method_facts(cfg).data == "labelled":  # a classifier: its label map names transformers' labels
        from lmforge.data.labelled import name_hf_labels

        name_hf_labels(Path(written), data_dir(cfg), cfg.model.num_labels)
    if method_facts(cfg).data == "tagged":  # a tagger: its tag map names transformers' labels
        from lmforge.data.labelled_tokens import name_hf_tags

        name_hf_tags(Path(written), data_dir(cfg), cfg.model.num_labels)
    return written


def export_adapter(
    src: str | Path, out: str | Path, overwrite: bool = False, weights: str = "model", say=print
) -> Path:
    """`out/adapter`: the run's adapters in PEFT's format; `out/base`: the base model they were trained
    on (template tokens' rows included, a QLoRA base dequantised) as a Hugging Face dir, which
    `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out/base), out/adapter)` loads."""
    from lmforge.models.hf import to_hf

    out = Path(out)
    cfg, ckpt = run_config(src)
    check_adapter_run(cfg, src)
    tok_path = _tokenizer(cfg, src)
    tokenizer = Tokenizer.load(tok_path)
    template = run_template(cfg)
    model, step = load_finetuned(cfg, ckpt, weights)
    base = _strip_adapters(load_finetuned(cfg, ckpt, weights)[0])

    def write(tmp: Path) -> None:
        save_peft_adapter(model, tmp / "adapter", str((out / "base").resolve()), cfg.model)
        eos = tokenizer.eos_id
        turn = tokenizer.token_id(template.end_of_turn) if template and template.end_of_turn else None
        to_hf(base, tmp / "base", bos_token_id=eos, eos_token_id=eos if turn in (None, eos) else [eos, turn])
        tokenizer.save_hf(
            tmp / "base",
            model_max_length=cfg.model.max_seq_len,
            chat_template=None if template is None else template.source,
        )

    write_output_dir(out, overwrite, [Path(src), ckpt, tok_path], write)
    say(
        f"exported the {cfg.finetune.method} adapters of {ckpt} (step {step}) to {out / 'adapter'} and their "
        f"base to {out / 'base'}"
    )
    return out


def merge_run(
    src: str | Path, out: str | Path, overwrite: bool = False, weights: str = "model", say=print
) -> Path:
    """An lmforge run dir at `out` whose one checkpoint holds the run's weights with the adapters merged
    (finetune.method=full), with the run's prepared data (tokenizer, template) copied beside it."""
    out = Path(out)
    cfg, ckpt = run_config(src)
    check_adapter_run(cfg, src)
    check_rebuildable(cfg, ckpt)
    model, step = load_merged(cfg, ckpt, weights)
    src_data = data_dir(cfg)
    new_cfg = cfg.model_copy(
        update={
            "run": cfg.run.model_copy(update={"dir": str(out), "name": f"{cfg.run.name}-merged"}),
            "data": cfg.data.model_copy(update={"dir": None}),
            "finetune": cfg.finetune.model_copy(update={"method": "full"}),
        }
    )

    def write(tmp: Path) -> None:
        if src_data.is_dir():
            shutil.copytree(src_data, tmp / "data", symlinks=False)
        CheckpointManager(tmp, keep_last=1).save(step, model, None, {})
        save_config(new_cfg, tmp / "config.yaml")

    write_output_dir(out, overwrite, [Path(src), ckpt, src_data], write)
    say(f"merged the {cfg.finetune.method} adapters of {ckpt} (step {step}) into {out}")
    return out


def _tokenizer(cfg, src) -> Path:
    tok = run_tokenizer_file(cfg)
    if tok is None:
        raise LmforgeError(f"the tokenizer of {src} is missing; was data.dir moved?")
    return tok


@torch.no_grad()
def _strip_adapters(model: nn.Module) -> nn.Module:
    """The frozen base under the adapters: each LoRA layer replaced by the layer it wraps, then any
    NF4 layer dequantised (`merged` of a model without adapters does only that)."""
    for name, layer in lora_layers(model).items():
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, layer.base)
    return merged(model)
