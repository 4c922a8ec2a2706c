"""Per-token heads in Hugging Face checkpoints: a tagger's (model.score_reads=token) as transformers'
...ForTokenClassification and an extractive reader's start / end head (span) as ...ForQuestionAnswering.

A family adapter knows its sequence classifier's names (the score head and the backbone's prefix); these
heads differ from it only in a few names, so they are that adapter seen through a rename (`with_head`):

    family   sequence (theirs)          token                       span
    llama    model.* + score.{p}        model.* + score.{p}         transformer.* + qa_outputs.{p}
    qwen2    (as llama)                 (as llama)                  (as llama)
    mistral  (as llama)                 (as llama)                  model.* + qa_outputs.{p}
    bert     classifier.{p}             classifier.{p}              qa_outputs.{p}
    roberta  classifier.out_proj.{p}    classifier.{p}              qa_outputs.{p}

(Llama's and Qwen2's ...ForQuestionAnswering keep the old `transformer` attribute for the backbone.)
Families without such a class here are refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

import torch

from lmforge.errors import LmforgeError

SUFFIX = {"sequence": "ForSequenceClassification", "token": "ForTokenClassification",
          "span": "ForQuestionAnswering"}
_HEADS = {  # model_type -> {reads: (the family adapter's head prefix, theirs)}
    "llama": {"token": ("score.", "score."), "span": ("score.", "qa_outputs.")},
    "mistral": {"token": ("score.", "score."), "span": ("score.", "qa_outputs.")},
    "qwen2": {"token": ("score.", "score."), "span": ("score.", "qa_outputs.")},
    "bert": {"token": ("classifier.", "classifier."), "span": ("classifier.", "qa_outputs.")},
    "roberta": {"token": ("classifier.out_proj.", "classifier."),
                "span": ("classifier.out_proj.", "qa_outputs.")},
}
# (the adapter's prefix, theirs): LlamaForQuestionAnswering and Qwen2's keep the old `transformer`
_BACKBONE = {("llama", "span"): ("model.", "transformer."), ("qwen2", "span"): ("model.", "transformer.")}
_CLASSES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "bert": "Bert", "roberta": "Roberta"}


def head_of(hf_cfg: dict[str, Any]) -> str | None:
    """What a checkpoint's head reads, from its architectures (None: a language model)."""
    archs = [str(a) for a in hf_cfg.get("architectures") or ()]
    return next((reads for reads, suffix in SUFFIX.items() if any(a.endswith(suffix) for a in archs)), None)


def head_config(hf_cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keys of a classifier / tagger / reader checkpoint's head: num_labels outputs
    (id2label's size; 2 when a config names neither, start and end for a reader). Its weights hold no
    language-model head, so the output projection is the tied embedding (no head task reads it)."""
    reads = head_of(hf_cfg)
    if reads is None:
        return {}
    labels = hf_cfg.get("id2label")
    n = len(labels) if isinstance(labels, dict) and labels else int(hf_cfg.get("num_labels") or 2)
    return {"score_head": True, "num_labels": 2 if reads == "span" else n, "score_reads": reads,
            "tie_embeddings": True}


class _Renamed:
    """`family` with its sequence head's names swapped for those of a token or span head."""

    def __init__(self, family: ModuleType, model_type: str, reads: str) -> None:
        if model_type not in _HEADS:
            raise LmforgeError(f"a {reads} head ({'token classification' if reads == 'token' else 'question'}"
                               f" answering) exports to and imports from Hugging Face {', '.join(_HEADS)} "
                               f"only, not {model_type!r}")
        self._family, self._type, self._reads = family, model_type, reads
        self._pairs = [_HEADS[model_type][reads], *([_BACKBONE[(model_type, reads)]]
                                                    if (model_type, reads) in _BACKBONE else [])]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._family, name)

    def _theirs(self, name: str) -> str:
        for ours, theirs in self._pairs:
            if name.startswith(ours):
                return theirs + name[len(ours):]
        return name

    def _adapters(self, name: str) -> str:
        for ours, theirs in self._pairs:
            if name.startswith(theirs):
                return ours + name[len(theirs):]
        return name

    def config_to_hf(self, cfg, model_type: str) -> dict[str, Any]:
        out = self._family.config_to_hf(cfg, model_type)
        out["architectures"] = [_CLASSES[model_type] + SUFFIX[self._reads]]
        return out

    def import_names(self, hf_name: str, cfg) -> list[str] | None:
        return self._family.import_names(self._adapters(hf_name), cfg)

    def import_tensor(self, hf_name: str, tensor: torch.Tensor, cfg) -> list[tuple[str, torch.Tensor]]:
        return self._family.import_tensor(self._adapters(hf_name), tensor, cfg)

    def hf_name(self, our_name: str, cfg) -> str:
        return self._theirs(self._family.hf_name(our_name, cfg))

    def export_tensors(self, state: Mapping[str, torch.Tensor], cfg) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._family.export_tensors(state, cfg):
            yield self._theirs(name), t


def with_head(family: ModuleType, cfg, model_type: str | None, reads: str | None = None
              ) -> ModuleType | _Renamed:
    """`family` as it reads and writes `cfg`'s head (or the head `reads` of the checkpoint it reads:
    its backbone's names follow the checkpoint's class): itself for a language model or a sequence
    head."""
    if reads is None:
        reads = getattr(cfg, "score_reads", "sequence") if getattr(cfg, "score_head", False) else None
    if reads in (None, "sequence"):
        return family
    return _Renamed(family, model_type or family.model_type_for(cfg, None), reads)
