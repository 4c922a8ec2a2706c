"""The one assembly: every part of a run built from its config, in one place and one order.

    run = build_run(cfg)                                   # lmforge train: run dir, data, model, optimizer...
    run = build_run(cfg, "experiment")                  # the same parts, no run dir (lr-find, benches)
    run = build_run(cfg, "eval", weights_from=ckpt)     # weights of a run, checkpoint or HF dir + val data
    run = build_run(cfg, "generate", weights_from=ckpt)    # weights + tokenizer only

The config is resolved first (model.init_from's architecture and tokenizer, then the vocabulary the
data's tokenizer needs) into a new, frozen tree: `run.cfg` is what config.yaml in the run dir holds,
and nothing changes it afterwards. The Python API's own pieces (a model object, datasets in memory,
a tokenizer object, an objective) replace the parts the config would build.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from lmforge.assembly.checks import (
    check_custom_model,
    check_layout,
    check_stated_heads,
    check_stated_vocab,
    check_user_optimizer,
)
from lmforge.assembly.methods import MethodSetup, SetupContext, method_setup
from lmforge.assembly.starting import starting_model
from lmforge.checkpoint.manager import list_checkpoints
from lmforge.checkpoint.run_dir import RunLock, mark_job, open_run_dir, restarted_job_owns
from lmforge.checkpoint.runs import (
    DERIVED_KEYS,
    check_rebuildable,
    resolve_init_from,
    run_tokenizer_file,
)
from lmforge.config.methods import method_facts
from lmforge.config.paths import input_paths
from lmforge.config.schema import Config
from lmforge.config.t5 import check_t5_training
from lmforge.data import PreparedData, Tokenizer, TokenLoader, data_dir, prepare
from lmforge.data.length import with_length
from lmforge.data.memory import token_stream
from lmforge.data.mixture import train_loader as mixture_or_tokens
from lmforge.data.sft import prepare_sft
from lmforge.data.tokenizer import KIND_NAMES
from lmforge.engine.act_offload import check_activation_offload
from lmforge.engine.fp8 import check_fp8, convert_fp8
from lmforge.engine.objectives import Objective, build_objective
from lmforge.engine.precision import Precision, probe_deadline, resolve_precision, set_tf32
from lmforge.engine.step import StepHook
from lmforge.errors import ConfigError, DataError, LmforgeError
from lmforge.finetune.setup import apply_finetune, load_finetuned
from lmforge.optim.batch_ramp import BatchRamp
from lmforge.optim.builder import SPECS, OptimizerFactory, UserOptimizer, build_optimizer
from lmforge.optim.master import keep_masters, start_master_weights
from lmforge.optim.offload import start_optimizer_offload
from lmforge.optim.schedule import LRSchedule
from lmforge.parallel.api import ParallelModel, parallelize
from lmforge.parallel.coord import on_rank0, rank0_first
from lmforge.parallel.dims import ParallelDims
from lmforge.parallel.process_group import init_distributed
from lmforge.parallel.world import World, resolve_device
from lmforge.utils.rng import seed_everything

Purpose = Literal["train", "experiment", "eval", "generate"]
Documents = Iterable[str | Sequence[int]]


@dataclass
class Run:
    """The parts of one run. Parts a purpose does not need are None."""

    cfg: Config  # resolved and frozen
    purpose: Purpose
    world: World
    device: torch.device
    model: nn.Module  # what the optimizer and checkpoints take (a pipeline rank: its stages)
    objective: Objective
    precision: Precision
    tokenizer: Tokenizer | None = None
    data: PreparedData | None = None  # the prepared data dir (None for data handed over in Python)
    dims: ParallelDims | None = None
    parallel: ParallelModel | None = None  # runs the steps (and the validation forwards)
    optimizer: torch.optim.Optimizer | None = None
    hooks: list[StepHook] = field(default_factory=list)  # the optimizer's extra work after each update
    schedule: LRSchedule | None = None
    ramp: BatchRamp | None = None
    train_loader: Any = None  # TokenLoader, or ChatLoader for fine-tuning
    val_loader: Any = None
    eval_batches: int | None = None  # batches per evaluation (None: the whole split)
    token_bytes: torch.Tensor | None = None  # UTF-8 bytes per token id (bits per byte)
    custom_model: bool = False  # the model came from the caller, not from cfg.model
    resumed: bool = False  # train: the run dir holds an earlier run to continue
    step: int = 0  # eval/generate: the step the weights were saved at
    weights_from: Path | None = None  # eval/generate: the checkpoint (or HF dir) of the weights
    lock: RunLock | None = None  # train, rank 0: the run dir's lock, held until `release()`
    template: Any = None  # fine-tuned runs: the ChatTemplate their conversations were rendered with
    on_release: list[Callable[[], None]] = field(default_factory=list)  # process settings to put back

    def release(self, refused: bool = False) -> None:
        """Give up the run dir's lock (the trainer does at the end of fit); `refused`: the run never
        trained, so what opening the run dir made goes too (RunLock.discard)."""
        if self.lock is not None:
            self.lock.discard() if refused else self.lock.release()
        while self.on_release:
            self.on_release.pop()()

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run.dir)


def build_run(
    cfg: Config,
    purpose: Purpose = "train",
    *,
    model: nn.Module | None = None,
    train_data: Documents | None = None,
    eval_data: Documents | None = None,
    tokenizer: Any = None,
    objective: Objective | None = None,
    resume: bool = False,
    weights_from: str | Path | None = None,
    weights: str = "model",
    say: Callable[[str], object] = print,
    optimizer: torch.optim.Optimizer | OptimizerFactory | None = None,
    param_groups: list[dict] | None = None,
) -> Run:
    """Build the parts `purpose` needs from `cfg` (see the module docstring). `optimizer` / `param_groups`:
    the user's optimizer or param groups (optim/builder.py UserOptimizer)."""
    world = World.from_env()
    threads = _threads(cfg, world, say if purpose in ("train", "experiment") else _stderr)
    if threads:
        torch.set_num_threads(threads)
    device = resolve_device(cfg.train.device, world)
    if purpose in ("train", "experiment"):  # what an encoder-decoder cannot do yet (config/t5.py)
        check_t5_training(cfg, world.world_size)
    if purpose in ("eval", "generate"):
        if weights_from is None:
            raise ValueError(
                f"build_run(purpose={purpose!r}) needs weights_from (a run, checkpoint or HF dir)"
            )
        return _build_inference(cfg, purpose, world, device, Path(weights_from), weights, objective)
    given = optimizer is not None or param_groups is not None
    user = UserOptimizer(optimizer, param_groups) if given else None
    check_fp8(cfg, device)  # before any work: a refusal leaves nothing behind
    check_activation_offload(cfg, device)
    restore_tf32 = set_tf32(cfg.train.tf32, device)
    try:
        run = _build_training(cfg, purpose, world, device, model, train_data, eval_data, tokenizer, objective,
                              resume, say, user)
    except BaseException:
        restore_tf32()
        raise
    run.on_release.append(restore_tf32)
    return run


def resolve_vocab_size(cfg: Config, tokenizer_vocab: int) -> int:
    """The model's vocabulary: the config's, or the tokenizer's rounded up to a multiple of 64
    (matmul-friendly; the extra rows are never targets)."""
    if cfg.model.vocab_size is None:
        return 64 * math.ceil(tokenizer_vocab / 64)
    if cfg.model.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer_vocab}); set it to at least {tokenizer_vocab} or leave it unset"
        )
    return cfg.model.vocab_size


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _threads(cfg: Config, world: World, say: Callable[[str], object]) -> int | None:
    """train.threads as a count (None: torch's default). `auto` is measured in a single process; the ranks
    of a job take their share of the cores (parallel.process_group), as when it is unset."""
    if cfg.train.threads != "auto" or world.world_size > 1:
        return cfg.train.threads if isinstance(cfg.train.threads, int) else None
    from lmforge.engine.threads import resolve_threads

    return resolve_threads("auto", rows=cfg.train.micro_batch_size * cfg.seq_len, d_model=cfg.model.d_model,
                           d_ff=cfg.model.resolved_d_ff, say=say)


# -- training and experiments -----------------------------------------------------------------------
def _build_training(cfg, purpose, world, device, model, train_data, eval_data, tokenizer, objective, resume,
                    say, user: UserOptimizer | None = None) -> Run:
    # A distributed job: join it (collective timeouts set); check the layout before any work.
    init_distributed(cfg.parallel.timeout_s, device,
                     cfg.train.threads if isinstance(cfg.train.threads, int) else None)
    custom = model is not None
    if custom and cfg.model.init_from:
        raise ConfigError("model.init_from loads weights into lmforge's Transformer; with a model object of "
                          "your own, load its weights before handing it over and unset model.init_from")
    stated: dict = {}
    if not custom:
        chat = method_facts(cfg).chat  # these grow the vocabulary and add the scalar heads
        if chat and cfg.model.init_from:  # a run's own config.yaml states what it derived: checked below
            stated = {k: getattr(cfg.model, k) for k in DERIVED_KEYS & cfg.model.model_fields_set}
        cfg = resolve_init_from(cfg, say=say, derived=chat)
        check_stated_heads(cfg, stated)
    if cfg.model.quant is not None:  # a quantized model's integer weights have no gradients
        source = f" (model.init_from={cfg.model.init_from})" if cfg.model.init_from else ""
        raise ConfigError(f"the model{source} is quantized (model.quant: int{cfg.model.quant.bits}, written "
                          "by `lmforge quantize`) and is for inference only; train or fine-tune the "
                          "full-precision run it was quantized from, then quantize the result")
    objective = objective or build_objective(cfg)
    dims = ParallelDims.resolve(cfg.parallel, world.world_size, None if custom else cfg.model,
                                cfg.train.grad_accum_steps)
    check_layout(cfg, dims, objective, custom)
    check_user_optimizer(user, dims, custom, cfg.train.master_weights)
    if world.world_size > 1:
        dims.build_mesh(device.type)
    resumed, lock = False, None
    if purpose == "train":
        run_dir = Path(cfg.run.dir)
        # torchrun --max-restarts: a restarted job continues from the last checkpoint by itself, but
        # only a run this job started (a first attempt refused for a foreign run dir must stay refused).
        resume = resume or on_rank0(lambda: restarted_job_owns(run_dir))
        if train_data is None:  # the sources must exist before run.overwrite deletes the old run
            facts = method_facts(cfg)
            section = getattr(cfg, facts.data_section)
            sources = ([*section.data, *section.val_data] if facts.chat
                       else [*section.source_paths, *section.val_sources])
            missing = [src for src in sources if src != "builtin:python" and not Path(src).exists()]
            if missing:
                where = Path(missing[0]).resolve()
                if facts.chat:
                    raise DataError(f"{facts.data_section} data {missing[0]!r} does not exist (resolved: "
                                    f"{where}); give .jsonl or .parquet files, folders of them or a saved "
                                    "datasets dir")
                raise DataError(f"data source {missing[0]!r} does not exist (resolved: {where}); give a "
                                "file, a folder or 'builtin:python'")
            if not facts.chat and not (
                cfg.run.overwrite and data_dir(cfg).resolve().is_relative_to(run_dir.resolve())
            ):  # (a data dir inside the run dir goes with the old run: nothing to check)
                from lmforge.data.prepare import check_reusable

                on_rank0(lambda: check_reusable(cfg))
        method_setup(cfg).check_inputs(cfg)  # checked before run.overwrite acts too
        locks: list[RunLock] = []  # rank 0's, kept here: the lock is a file descriptor, not broadcast

        def open_dir() -> bool:
            resumed, lock = open_run_dir(run_dir, resume=resume, overwrite=cfg.run.overwrite, say=say,
                                         inputs=input_paths(cfg))
            locks.append(lock)
            return resumed

        resumed = on_rank0(open_dir)
        lock = locks[0] if locks else None
        if world.is_main:
            mark_job(run_dir)
    try:
        return _training_parts(cfg, purpose, world, device, model, train_data, eval_data, tokenizer,
                               objective, dims, resumed, lock, say, stated_vocab=stated.get("vocab_size"),
                               user=user)
    except BaseException:
        if lock is not None:  # a run that could not be assembled leaves its run dir as it found it
            lock.discard()
        raise


def _add_head(cfg: Config, model: nn.Module, head: str) -> Config:
    """The method's head (a score, value or classifier head) added with the run's seed; the config then
    says so (model.<head>_head, model.num_labels)."""
    from lmforge.models.transformer import add_head

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.run.seed)
        add_head(model, head, outputs=method_facts(cfg).head_outputs, reads=method_facts(cfg).head_reads)
    heads = {f"{head}_head": True, "num_labels": model.cfg.num_labels, "score_reads": model.cfg.score_reads}
    return cfg.model_copy(update={"model": cfg.model.model_copy(update=heads)})


def _training_parts(cfg, purpose, world, device, model, train_data, eval_data, tokenizer, objective, dims,
                    resumed, lock, say, stated_vocab: int | None = None,
                    user: UserOptimizer | None = None) -> Run:
    custom = model is not None
    sft = method_facts(cfg).chat  # chat data, a template, fine-tuning a given model
    if sft:
        if train_data is not None:
            raise ConfigError(f"objective {cfg.objective.name} reads its chat data from the config "
                              "(sft.data / preference.data / rl.data); train_data= is for pretraining "
                              "documents")
        # A fresh run owns the data dir inside its run dir: changed chat data is prepared again there.
        own = not resumed and cfg.data.dir is None
        data = rank0_first(lambda: prepare_sft(cfg, console=say, replace=own))
        tokenizer, train_src, val_src = data.tokenizer, None, None
    else:
        data, tokenizer, train_src, val_src = _training_data(cfg, train_data, eval_data, tokenizer, say)
    source_vocab = cfg.model.vocab_size
    cfg = _fit_vocabulary(cfg, custom, sft, data, tokenizer, train_src, dims, stated_vocab, say)

    seed_everything(cfg.run.seed)  # the same seed on every rank: replicas start equal
    if custom:
        model = model.to(device)
        vocab = check_custom_model(model, tokenizer, train_src, device)
    else:
        # A resumed run without a checkpoint yet (it died before its first) starts like a new one.
        fresh = not resumed or not on_rank0(lambda: bool(list_checkpoints(Path(cfg.run.dir) / "checkpoints")))
        model = starting_model(cfg, device, data if sft else None, source_vocab, load=fresh)
        if fresh and cfg.model.init_from:
            say(f"initialised the weights from {cfg.model.init_from}")
        vocab = cfg.model.vocab_size
    head = method_facts(cfg).scalar_head  # a reward model's score or PPO's value head: added, always trained
    if head and not custom:
        cfg = _add_head(cfg, model, head)
    if cfg.finetune.method != "full" or sft:
        say(apply_finetune(model, cfg.finetune, seed=cfg.run.seed).line())
        if head and not custom:
            getattr(model, head).requires_grad_(True)  # PEFT's modules_to_save
    setup = method_setup(cfg)  # the method's own parts: a reference, a teacher, a rollout, ...
    refs = setup.attach(objective, SetupContext(cfg, model, dims, device, data, tokenizer, source_vocab, say))
    objective.check_model(model)
    precision = Precision(on_rank0(lambda: resolve_precision(
        cfg.train.precision, device, model, cfg.train.micro_batch_size, cfg.seq_len, vocab, say=say,
        deadline_s=probe_deadline(cfg.train.max_time))), device, cfg.train.activation_offload)
    convert_fp8(model, cfg, precision.name, say)  # before compile and FSDP wrap the Linear layers
    masters = start_master_weights(cfg, dims, precision.name, model)  # bf16 weights before DDP wraps them
    # TP -> activation checkpointing -> compile -> FSDP/DDP, from outside the model.
    parallel = parallelize(model, cfg, dims, precision.name, objective)
    optimizer = parallel.wrap_optimizer(build_optimizer(parallel.model, cfg.optim, user))
    own = user is not None and user.brings_optimizer  # the logged lr is then its first group's
    if masters is not None:
        keep_masters(optimizer, masters)
    start_optimizer_offload(cfg, dims, device, optimizer)
    tc = cfg.train
    # Every rank must run the same number of evaluation batches (their forwards are collective);
    # a pipeline splits each one into its micro-batches.
    val_rows = tc.micro_batch_size * (dims.microbatches(tc.grad_accum_steps) if dims.pp > 1 else 1)
    val_loader = None
    if sft:
        train_loader, val_loader = _chat_loaders(setup, cfg, data, dims, world, val_rows, refs)
    else:
        train_loader = mixture_or_tokens(cfg, data, train_src, tc.micro_batch_size, dims.dp_rank,
                                         dims.dp_size)
    if val_src is not None:
        val_loader = TokenLoader(val_src, cfg.seq_len, val_rows, seed=cfg.run.seed, rank=dims.dp_rank,
                                 world_size=dims.dp_size, shuffle=False, drop_last=world.world_size > 1)
    cfg = with_length(cfg, train_loader, dims.dp_size, say)  # train.epochs / max_tokens -> max_steps
    ramp, tc = BatchRamp(cfg, dims.dp_size), cfg.train
    base_lr = optimizer.param_groups[0]["lr"] if own else cfg.optim.lr
    schedule = LRSchedule(
        cfg.schedule, optimizer, base_lr, tc.max_steps, ramp.total_tokens(tc.max_steps), tc.max_time
    )
    return Run(
        cfg=cfg,
        purpose=purpose,
        world=world,
        device=device,
        model=parallel.model,
        objective=objective,
        precision=precision,
        tokenizer=tokenizer,
        data=data,
        dims=dims,
        parallel=parallel,
        optimizer=optimizer,
        hooks=[] if own else SPECS[cfg.optim.name].hooks(optimizer),
        schedule=schedule,
        ramp=ramp,
        train_loader=train_loader,
        val_loader=val_loader,
        # The same sequences as `eval_batches` micro-batches, whatever the rows per batch.
        eval_batches=max(1, math.ceil(tc.eval_batches * tc.micro_batch_size / val_rows)),
        token_bytes=_token_bytes(tokenizer),
        custom_model=custom,
        resumed=resumed,
        lock=lock,
        template=data.template if sft else None,
    )


def _fit_vocabulary(cfg: Config, custom: bool, sft: bool, data, tokenizer, train_src, dims: ParallelDims,
                    stated_vocab: int | None, say) -> Config:
    """`cfg` with the model's vocabulary sized for the data (grown for a chat template's new tokens, whose
    rows then train beside adapters); refuses a stated vocabulary that differs, and trained token rows in
    a layout that splits the table."""
    source_vocab = cfg.model.vocab_size
    if not custom:
        vocab = tokenizer.vocab_size if tokenizer is not None else int(max(s.max() for s in train_src)) + 1
        if sft and cfg.model.init_from and source_vocab is not None and vocab > source_vocab:
            vocab_size = 64 * math.ceil(vocab / 64)  # the template's tokens need rows: grown after loading
            say(f"the chat template adds {vocab - data.meta['base_vocab']} tokens: vocabulary "
                f"{source_vocab} -> {vocab_size}")
        else:
            vocab_size = resolve_vocab_size(cfg, vocab)
        check_stated_vocab(stated_vocab, vocab_size, source_vocab)
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": vocab_size})})
    if sft and cfg.finetune.method != "full" and data.meta["added_tokens"]:
        # The template's new tokens must learn (an adapter run freezes the table): their rows train.
        tokens = sorted(set(cfg.finetune.train_tokens) | set(data.meta["added_tokens"]))
        cfg = cfg.model_copy(update={"finetune": cfg.finetune.model_copy(update={"train_tokens": tokens})})
    if cfg.finetune.train_tokens and (dims.fsdp or dims.tp > 1 or dims.pp > 1):
        raise ConfigError("finetune.train_tokens (under adapters, the rows of a chat template's new tokens "
                          "train) needs the whole token table on each rank: one process or DDP, not FSDP, "
                          "tensor or pipeline parallelism; use a template whose tokens the model has "
                          "(sft.template) or finetune.method=full")
    return cfg


def _chat_loaders(setup: MethodSetup, cfg: Config, data, dims: ParallelDims, world: World, val_rows: int,
                  refs=None):
    tc = cfg.train
    pad = data.tokenizer.eos_id
    ref = (lambda name: {"ref_logps": refs[name]}) if refs else (lambda name: {})  # noqa: E731
    train = setup.loader(cfg, data, "train", tc.micro_batch_size, seed=cfg.run.seed, rank=dims.dp_rank,
                         world_size=dims.dp_size, pad_id=pad, **ref("train"))
    val = None
    if len(data.split("val")):
        val = setup.loader(cfg, data, "val", val_rows, seed=cfg.run.seed, rank=dims.dp_rank,
                           world_size=dims.dp_size, shuffle=False, drop_last=world.world_size > 1, pad_id=pad,
                           **ref("val"))
    return train, val




def _training_data(cfg, train_data, eval_data, tokenizer, say):
    """(prepared data, tokenizer, train shards, val shards or None) from the config's sources, or from
    documents handed over in Python."""
    if train_data is None:
        if eval_data is not None or tokenizer is not None:
            raise ConfigError("eval_data= and tokenizer= go with train_data=; without train_data the data "
                              "comes from the config (data.sources, data.tokenizer)")
        data = rank0_first(lambda: prepare(cfg, console=say))
        return data, data.tokenizer, data.shards("train"), data.shards("val")
    docs = train_data if isinstance(train_data, (list, tuple)) else list(train_data)
    if tokenizer is not None:
        tok = Tokenizer.of(tokenizer)
    elif any(isinstance(d, str) for d in docs):
        tc = cfg.data.tokenizer
        say(f"training a {tc.vocab_size}-token {KIND_NAMES[tc.kind]} on train_data (pass tokenizer= to use "
            "your own)")
        tok = Tokenizer.train((d for d in docs if isinstance(d, str)), tc.vocab_size, tc.min_frequency,
                              tc.kind)
    else:
        tok = None
    train = token_stream(docs, tok, "train_data")
    val = token_stream(eval_data, tok, "eval_data") if eval_data is not None else None
    return None, tok, [train], None if val is None else [val]


def _token_bytes(tokenizer: Tokenizer | None) -> torch.Tensor | None:
    return None if tokenizer is None else torch.as_tensor(tokenizer.token_byte_lengths(), dtype=torch.long)


# -- evaluation and generation ----------------------------------------------------------------------
def _build_inference(cfg, purpose, world, device, weights_from: Path, weights: str, objective) -> Run:
    check_rebuildable(cfg, weights_from)
    tok_path = run_tokenizer_file(cfg)
    if tok_path is None:
        raise LmforgeError(
            f"the tokenizer of {weights_from} is missing ({data_dir(cfg) / 'tokenizer.json'}); "
            "was data.dir moved?"
        )
    tokenizer = Tokenizer.load(tok_path)
    if purpose == "generate" and cfg.model.arch == "encoder":
        raise ConfigError(f"{weights_from} is a masked-LM encoder (model.arch=encoder): it fills in masked "
                          "tokens and does not generate text; `lmforge eval` reports its MLM loss and "
                          "accuracy")
    model, step = load_finetuned(cfg, weights_from, weights, device)
    objective = objective or build_objective(cfg)
    run = Run(cfg=cfg, purpose=purpose, world=world, device=device, model=model, objective=objective,
              precision=Precision("fp32", device), tokenizer=tokenizer, step=step, weights_from=weights_from)
    setup = method_setup(cfg)
    if method_facts(cfg).chat:
        return _sft_inference(run, cfg, purpose, setup)
    if purpose == "generate":
        return run
    setup.attach_eval(run, None)  # (a teacher, the mask token ids) before the data, as training does
    data = prepare(cfg, console=lambda *_: None)
    try:
        shards = data.shards(cfg.eval.split)
    except DataError as e:
        raise DataError(f"eval.split={cfg.eval.split}: {e}") from None
    run.data = data
    run.val_loader = TokenLoader(shards, cfg.seq_len, cfg.eval.batch_size, shuffle=False, drop_last=False)
    run.eval_batches = cfg.eval.max_batches
    run.precision = Precision(resolve_precision(cfg.train.precision, device, model, cfg.eval.batch_size,
                                                cfg.seq_len, cfg.model.vocab_size, backward=False), device)
    run.token_bytes = _token_bytes(tokenizer)
    return run


def _sft_inference(run: Run, cfg: Config, purpose: Purpose, setup: MethodSetup) -> Run:
    """A fine-tuned run: its chat template (and, to evaluate, its prepared conversations or pairs)."""
    from lmforge.data.sft import load_prepared_sft

    data = load_prepared_sft(data_dir(cfg))
    run.template = data.template
    if purpose == "generate":
        return run
    if not len(data.split(cfg.eval.split)):
        section = method_facts(cfg).data_section
        raise DataError(f"eval.split={cfg.eval.split}: the run holds no {cfg.eval.split} examples (set "
                        f"{section}.val_fraction or {section}.val_data when fine-tuning, or "
                        "eval.split=train)")
    run.val_loader = setup.loader(cfg, data, cfg.eval.split, cfg.eval.batch_size, shuffle=False,
                                  drop_last=False, pad_id=data.tokenizer.eos_id)
    setup.attach_eval(run, data)  # a reference, a rollout
    run.eval_batches = cfg.eval.max_batches
    precision = resolve_precision(cfg.train.precision, run.device, run.model, cfg.eval.batch_size,
                                  cfg.seq_len, cfg.model.vocab_size, backward=False)
    run.precision = Precision(precision, run.device)
    run.token_bytes = _token_bytes(run.tokenizer)
    return run
