"""What a training method changes in `lmforge estimate` (tools/estimate.py), read from the config's
objective and finetune sections: which weights take gradients and optimizer state, how the frozen ones
are stored, which models sit beside the trained one, how many rows a micro-batch holds and what its loss
keeps; and the methods the estimate refuses, each by name, rather than answer with another's numbers.

  objective causal_lm, sft   the logits and cross-entropy; sft packs conversations into rows
      (sft.packing: restarting positions and, on the CPU, a (B, T, T) mask per layer). Every position is
      counted as a target: masked prompt tokens only lower the peak
  objective dpo              train.micro_batch_size pairs: 2 rows each (chosen and rejected; KTO: an
      example and its mismatched twin) through the policy, each row's summed log-probabilities; the
      reference model's forward (no gradients) before the step's first forward: a frozen fp32 copy of
      the starting model with full fine-tuning, the base with its adapters off under LoRA, none for
      simpo / orpo or with preference.precompute_reference (then one pass before training)
  objective reward           pairs as dpo, a scalar score head at each row's last token: no logits
  finetune full              every weight trains
  finetune lora / qlora      the base frozen (no gradients, no optimizer state); qlora's block linears in
      NF4 (finetune/nf4.py: 4 bits per weight, a byte per 64-weight block, two 1 KiB code tables per
      layer), loaded as fp32 first; fp32 adapters A (r, in) and B (out, r) on the matched linears,
      with their gradients and optimizer state; finetune.train_tokens' rows (and their ids); what the
      adapters save for backward is estimate_adapters'
Refused: objective rl and distill, finetune.method dora, adapters with FSDP / tensor / pipeline / expert
parallelism, on a mixture of experts, on the output or score head, with model.dropout or selective
activation checkpointing; and what a run itself refuses (the objective's own checks, a pipeline for a
loss without stages, a full-copy reference under sharding).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lmforge.config.methods import method_facts
from lmforge.config.schema import Config
from lmforge.errors import ConfigError
from lmforge.tools.estimate_adapters import BLOCK_LINEARS, Adapters, adapter_elements
from lmforge.tools.estimate_parts import ModelTensors, TensorInfo

_MEASURE = "measure a short run instead (the same config with train.max_steps=3)"
# what the estimate does not model, by the method's facts (config/methods.py)
_SAMPLING = "completions sampled through a KV cache, a reference model and a reward model per step"
_TEACHER = "a teacher model's forward and its vocabulary-wide divergence terms"
# bytes of the two code tables every NF4 layer keeps beside its weight (byte_table 256 x 2 fp32,
# absmax_code 256 fp32)
NF4_TABLES = 256 * 2 * 4 + 256 * 4


@dataclass(frozen=True)
class Method:
    """The training method of a config, as the memory estimate needs it."""

    objective: str
    finetune: str  # full, lora or qlora
    data: str  # what it reads: tokens, chat, pairs, unpaired (config/methods.py's facts)
    rows: int  # rows per micro-batch item: 2 for a pair (or a KTO example and its twin)
    head: str  # logits, logps or score (estimate_parts._head_saved)
    packed: bool  # sft.packing: several conversations per row
    reference: str  # "" (none), "copy" (a frozen copy of the starting model) or "adapters off"
    precompute: bool  # the reference's log-probs computed once before training, then the reference freed
    adapters: Adapters | None

    @property
    def chat(self) -> bool:
        """A fine-tuning method over chat data (a template, maybe added tokens)."""
        return self.data != "tokens"

    @property
    def label(self) -> str:
        text = self.objective
        if self.reference:
            text += f" (reference: {'frozen copy' if self.reference == 'copy' else 'base, adapters off'}"
            text += ", computed ahead)" if self.precompute else ")"
        if self.adapters is not None:
            text += f", {self.finetune} r={self.adapters.r}"
        elif self.chat:
            text += ", full fine-tuning"
        return text


def method_of(cfg: Config, layout) -> Method:
    """The method `cfg` trains with on `layout` (estimate.Layout); ConfigError for what the estimate
    does not model, naming it, and for what a run would refuse."""
    name, ft, facts = cfg.objective.name, cfg.finetune.method, method_facts(cfg)
    if facts.data == "prompts" or "teacher" in facts.extra_models:
        what = _SAMPLING if facts.data == "prompts" else _TEACHER
        raise ConfigError(f"objective {name} ({what}) is not modelled by lmforge estimate: {_MEASURE}")
    if ft == "dora":
        raise ConfigError("finetune.method=dora (the weight-decomposed adapters' norms and scaled base "
                          f"outputs) is not modelled by lmforge estimate: {_MEASURE}, or estimate "
                          "finetune.method=lora (DoRA takes more)")
    from lmforge.engine.objectives import build_objective

    # the objective's own refusals (e.g. a chunked loss for pairs), as a run makes them
    objective = build_objective(cfg)
    if not objective.supports_pipeline and layout.pp > 1:
        raise ConfigError(f"objective {name} has no per-stage loss, so it cannot run in a pipeline "
                          "(parallel.pp > 1)")
    reference = ""
    if "reference" in facts.extra_models:
        reference = "copy" if ft == "full" else "adapters off"
    precompute = bool(reference) and cfg.preference.precompute_reference
    if precompute and cfg.preference.loss == "kto":
        raise ConfigError("preference.precompute_reference does not apply to loss kto: its reference point "
                          "comes from pairs of examples within each batch; set it to false")
    if reference == "copy" and (layout.fsdp or layout.tp > 1 or layout.pp > 1):
        raise ConfigError(f"objective {name} with finetune.method=full keeps a frozen copy of the model as "
                          "its reference, which needs the whole model on each rank (one process or DDP); use "
                          "LoRA or a reference-free loss (preference.loss=simpo or orpo)")
    pairs = facts.batch_rows == 2  # a pair's two rows (or a KTO example and its twin)
    head = "score" if facts.scalar_head == "score" else "logps" if pairs else "logits"
    adapters = _adapters(cfg, layout, head) if ft != "full" else None
    return Method(name, ft, facts.data, facts.batch_rows, head, facts.data == "chat" and cfg.sft.packing,
                  reference, precompute, adapters)


def _adapters(cfg: Config, layout, head: str) -> Adapters:
    from lmforge.finetune.lora import match_targets

    m, ft = cfg.model, cfg.finetune
    what = f"finetune.method={ft.method}"
    if layout.fsdp or layout.tp > 1 or layout.pp > 1 or layout.ep > 1:
        raise ConfigError(f"{what} is modelled by lmforge estimate on one process or with DDP (parallel."
                          f"dp_replicate), not with the layout {layout.name}: {_MEASURE}")
    for bad, why in ((m.moe is not None, "on a mixture of experts (model.moe)"),
                     (m.any_dropout, "with model.dropout (or attention_dropout / hidden_dropout) > 0"),
                     (cfg.train.activation_checkpointing == "selective",
                      "with train.activation_checkpointing=selective")):
        if bad:
            raise ConfigError(f"{what} {why} is not modelled by lmforge estimate: {_MEASURE}")
    r, targets, dropout = ft.r, ft.targets, ft.dropout
    if ft.init_adapter:
        from lmforge.finetune.peft_io import read_adapter_config

        settings = read_adapter_config(ft.init_adapter)
        if settings["dora"]:
            raise ConfigError(f"finetune.init_adapter={ft.init_adapter} holds DoRA adapters, which lmforge "
                              f"estimate does not model: {_MEASURE}")
        if isinstance(settings["targets"], str) and settings["targets"] != "all-linear":
            raise ConfigError(f"finetune.init_adapter={ft.init_adapter} names its target modules by a "
                              "regular expression, which lmforge estimate does not resolve: set "
                              "finetune.targets to the layers it adapts and unset init_adapter to estimate")
        r, targets = settings["r"], settings["targets"]
    kinds = [n for n in BLOCK_LINEARS if m.mlp in ("swiglu", "geglu") or n != "mlp.w_gate"]
    names = [f"layers.{i}.{n}" for i in range(m.n_layers) for n in kinds]
    heads = ([] if m.tie_embeddings else ["output"]) + (["score"] if head == "score" else [])
    chosen = match_targets(names + heads, targets)
    if any(n in heads for n in chosen):
        raise ConfigError(f"adapters on the output or score head (finetune.targets={targets}) are not "
                          f"modelled by lmforge estimate: {_MEASURE}")
    per_block: list[set[str]] = [set() for _ in range(m.n_layers)]
    for n in chosen:
        _, i, rest = n.split(".", 2)
        per_block[int(i)].add(rest)
    return Adapters(r, tuple(frozenset(s) for s in per_block), ft.method == "qlora", dropout,
                    bool(ft.train_tokens))


def method_tensors(mt: ModelTensors, cfg: Config, method: Method) -> ModelTensors:
    """The model's tensors as `method` trains them: frozen base tensors take no gradient and no
    optimizer state; NF4 weights hold their own bytes; adapters, trained token rows and a reward
    model's score head are added."""
    m = cfg.model
    out = list(mt.tensors)
    if method.head == "score":
        # the vocabulary projection is not used: an untied head gets no gradient, and neither head is
        # cast for a matmul
        out = [replace(t, trainable=False, in_optimizer=False, matmul=False) if t.name == "output.weight"
               else replace(t, matmul=False) if t.name == "tok_embeddings.weight" else t for t in out]
        if not any(t.name == "score.weight" for t in out):
            out.append(TensorInfo("score.weight", (1, m.d_model), None, True, False, local=m.d_model,
                                  local_dim0=1))
    ad = method.adapters
    if ad is None:
        return ModelTensors(out, mt.cfg)
    from lmforge.finetune.nf4 import nf4_storage_bytes

    frozen = []
    for t in out:
        if t.name == "score.weight":  # PEFT's modules_to_save: trained whole
            frozen.append(t)
            continue
        t = replace(t, trainable=False, in_optimizer=False)
        if ad.nf4 and t.hidden:  # a block linear's weight, stored in NF4 (quantize_model_nf4)
            stored = nf4_storage_bytes(t.numel, cfg.finetune.quant_blocksize) + NF4_TABLES
            t = replace(t, matmul=False, stored=stored)  # dequantised per use: no autocast copy kept
        frozen.append(t)
    for name, shape, block in adapter_elements(cfg, ad):
        frozen.append(TensorInfo(name, shape, block, True, False, local=shape[0] * shape[1],
                                 local_dim0=shape[0]))
    if ad.token_rows:
        k = len(set(cfg.finetune.train_tokens))
        for table in ["tok_embeddings"] + ([] if m.tie_embeddings else ["output"]):
            frozen.append(TensorInfo(f"{table} trained rows", (k, m.d_model), None, False, False,
                                     local=k * m.d_model, local_dim0=k, stored=k * (m.d_model * 4 + 8)))
    return ModelTensors(frozen, mt.cfg)


def reference_transient(cfg: Config, rows: int) -> int:
    """Bytes a forward without gradients (the reference model's, in fp32: outside autocast) holds at
    its fullest: the final hidden states, the logits and their log-softmax at the head, or a block's
    stream, normed input and MLP intermediates."""
    m = cfg.model
    N = rows * cfg.seq_len
    head = N * (m.d_model + 2 * m.vocab_size) * 4
    block = N * (2 * m.d_model + 3 * m.resolved_d_ff) * 4
    return max(head, block)


def load_peak(held: list[TensorInfo]) -> int:
    """QLoRA's load: quantize_model_nf4 keeps every fp32 linear until all are converted, so the fp32
    model and the NF4 weights are held at once, beside the quantisation's scratch for the largest layer
    (about 10 bytes per weight: its scaled values, their int32 codes, the packed result)."""
    fp32 = sum(t.numel for t in held if not t.trainable) * 4  # the base as loaded (adapters come after)
    nf4 = sum(t.stored for t in held if t.stored is not None)
    largest = max((t.numel for t in held if t.stored is not None), default=0)
    return fp32 + nf4 + 10 * largest


def dense_packed_mask(cfg: Config, device_type: str) -> bool:
    """Whether packed rows attend through a (B, T, T) mask (the CPU's kernel) rather than flex attention."""
    import torch

    from lmforge.models.common.attention import packed_kernel

    m = cfg.model
    return packed_kernel("auto", torch.device(device_type), m.resolved_attention_dropout,
                         m.resolved_head_dim) == "mask"


def trainable_elements(held, layers: list[int], method: Method) -> tuple[int, list[int]] | None:
    """(trainable elements outside the blocks, per block of `layers`) where some weights are frozen."""
    if method.adapters is None and method.head != "score":
        return None
    per_block = dict.fromkeys(layers, 0)
    root = 0
    for t in held:
        if t.trainable:
            if t.block is None:
                root += t.local
            else:
                per_block[t.block] += t.local
    return root, [per_block[i] for i in layers]


def method_moments(cfg: Config, method: Method, held, B: int, base: int, rows: dict[str, int],
                   moments: dict[str, int], notes: list[str]) -> None:
    """The moments a method adds to a step: the reference model's forward (before the step's first
    forward: no gradients yet), its pass before training when computed ahead, QLoRA's load."""
    params = sum(v for k, v in rows.items() if k.startswith("parameters"))
    if method.reference:
        transient = reference_transient(cfg, B)
        if method.precompute:  # before the optimizer exists; a full copy is freed afterwards
            copy = sum(t.numel for t in held) * 4 if method.reference == "copy" else 0
            moments["reference log-probs computed ahead (before training)"] = params + copy + transient
        else:
            moments["reference forward (no gradients)"] = base + transient
    if method.adapters is not None and method.adapters.nf4:
        moments["model load (fp32 weights before NF4)"] = load_peak(held)
    if method.data == "chat":
        notes.append("every position is counted as a target (prompt tokens without loss only lower the peak)")
    if method.adapters is not None and not method.adapters.token_rows and method.chat:
        notes.append("a chat template that adds tokens makes their rows train beside the adapters, which "
                     "takes a vocabulary x d_model table more; set finetune.train_tokens to count it")


def weight_copies(held: list[TensorInfo], prof) -> int:
    """Bytes of the 2-byte weight copies autocast makes and backward keeps: every matmul weight's, or
    where the profile knows better (a frozen base, estimate_adapters) its blocks' and the rest's."""
    if prof.block_copies is None:
        return sum(t.local for t in held if t.matmul) * 2
    return sum(t.local for t in held if t.matmul and t.block is None) * 2 + prof.block_copies
