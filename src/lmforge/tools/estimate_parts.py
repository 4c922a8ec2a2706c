"""The parts of the memory estimate (tools/estimate.py): the model's tensors, each optimizer's state
and step scratch, and the activations autograd saves, op by op.

Activation bytes follow what the ops of lmforge's Transformer save for backward (checked against
`torch.autograd.graph.saved_tensors_hooks` in tests/unit/test_estimate.py), per token of a
micro-batch, with d = d_model, h / hk = query / key-value heads on this rank, D = head_dim,
F = d_ff on this rank, c = bytes of the compute dtype:

  RMSNorm (F.rms_norm, decomposed by autograd): input x, rstd, x * rstd     (fp32 residual stream)
  LayerNorm: input x, mean, rstd
  each linear: its input (fp32: the norm's output shared by wq/wk/wv; under autocast each linear
      casts it itself, so wq, wk, wv save three copies)
  attention (SDPA flash kernel, CPU and CUDA): q, k, v, output (the same storage as wo's input),
      logsumexp (fp32, per head); with a dense mask (sliding window, packed rows) the mask as a
      float tensor per layer; with attention dropout the math kernel: scores and probabilities
  SwiGLU: gate out, silu out, up out, their product (w_down's input); GELU: up out, gelu out
  loss: log_softmax output (N x V, fp32) and targets; the logits themselves are not saved
  mixture of experts (model.moe, models/moe.py; moe_saved), with M routed rows (N * top_k dropless;
      with a capacity the balanced load's min(N * top_k, E * capacity)) and E_l experts on this rank:
      router scores (N x E), logits and their logsumexp (the z statistic, computed in every training
      forward), top-k indices (int64), with norm_topk_prob the top-k scores and their sum; the sort
      order and token indices (M, int64 each), the gathered rows (M x d), each expert's SwiGLU on its
      rows (4 F_e per row: the total does not depend on how the rows are spread over the experts),
      the experts' gate and up weights concatenated once per forward (E_l x 2 F_e x d, the CPU loop;
      the CUDA grouped GEMM reads the parameters), the expert outputs and their router-weighted copy
      (M x d each, for the weighting and the scatter-add), the weights per row (M); shared experts a
      SwiGLU MLP (4 F_s per token) and with their gate its sigmoid and the MLP output; with expert
      parallelism (ep) two more index vectors (M, int64) around the all-to-all
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from lmforge.config.schema import Config, ModelConfig
from lmforge.optim.memory import MEMORY

if TYPE_CHECKING:
    from lmforge.tools.estimate_adapters import Adapters

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_COLWISE = ("attn.wq", "attn.wk", "attn.wv", "mlp.w_gate", "mlp.w_up")
_ROWWISE = ("attn.wo", "mlp.w_down")


@dataclass(frozen=True)
class TensorInfo:
    """One parameter: whole shape, which block it lives in, and how it is used."""

    name: str
    shape: tuple[int, ...]
    block: int | None  # transformer block index; None for embeddings, final norm, head
    matmul: bool  # a matmul weight: autocast casts it (and keeps the copy for backward)
    hidden: bool  # a block's linear weight (Muon's matrices)
    expert: bool = False  # a routed experts' stacked weight (E, ...): split by parallel.ep, not by FSDP
    local: int = 0  # elements on this rank after tensor parallelism
    local_dim0: int = 0  # rows on this rank (FSDP shards dim 0 further)
    trainable: bool = True
    in_optimizer: bool = True
    stored: int | None = None  # bytes held where they are not 4 per element (an NF4 weight)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def sharded(self, n: int) -> TensorInfo:
        """This tensor's FSDP shard over n ranks (dim 0 split, padded)."""
        if n == 1:
            return self
        rows = math.ceil(self.local_dim0 / n)
        rest = self.local // max(self.local_dim0, 1)
        shape = (rows,) + tuple(self.shape[1:]) if len(self.shape) > 1 else (rows,)
        return replace(self, shape=shape, local=rows * rest, local_dim0=rows)


@dataclass
class ModelTensors:
    tensors: list[TensorInfo]
    cfg: ModelConfig

    def held(self, layers: list[int], first: bool, last: bool, tp: int, ep: int = 1) -> list[TensorInfo]:
        """The tensors a rank holds: its pipeline stage's blocks (embeddings on the first stage, final
        norm and head on the last; a tied head's table as a gradient-carrying copy outside the
        optimizer), each split by tensor parallelism as lmforge.parallel.tensor_parallel splits it."""
        tied = self.cfg.tie_embeddings
        keep = set(layers)
        out = []
        for t in self.tensors:
            if t.block is not None and t.block not in keep:
                continue
            if t.block is None:
                is_first = t.name.startswith(("tok_embeddings", "pos_embeddings"))
                if is_first and not first:
                    continue
                if not is_first and not last:
                    continue
            if tp > 1:
                t = _tp_split(t, tp, tied)
            if t.expert and ep > 1:  # this rank's slice of the experts (expert_parallel.apply_ep)
                t = replace(t, local=t.local // ep, local_dim0=t.local_dim0 // ep)
            out.append(t)
        if last and not first and tied:
            table = next(t for t in self.tensors if t.name == "tok_embeddings.weight")
            copy = replace(_tp_split(table, tp, tied), name="head copy of tok_embeddings", in_optimizer=False)
            out.append(copy)
        return out


def _tp_split(t: TensorInfo, tp: int, tied: bool) -> TensorInfo:
    rows = t.shape[0]
    numel = t.numel
    if tp > 1:
        if t.block is not None and t.name.endswith(tuple(f"{n}.weight" for n in _COLWISE) +
                                                   tuple(f"{n}.bias" for n in _COLWISE)):
            rows, numel = rows // tp, numel // tp
        elif t.block is not None and t.name.endswith(tuple(f"{n}.weight" for n in _ROWWISE)):
            numel = numel // tp
        elif t.name in ("output.weight",) or (t.name == "tok_embeddings.weight" and not tied):
            rows, numel = math.ceil(rows / tp), math.ceil(rows / tp) * (numel // rows)
    return replace(t, local=numel, local_dim0=rows)


def model_tensors(cfg: ModelConfig) -> ModelTensors:
    """Every parameter of the model `cfg` builds. Blocks are alike, so one block is built (on the meta
    device: no memory, and the names and shapes are the model code's own) and repeated n_layers times:
    the cost does not grow with the model's depth beyond a list of its tensors."""
    if cfg.vocab_size is None:
        from lmforge.errors import ConfigError

        raise ConfigError("model.vocab_size is not set: the estimate needs it (set model.vocab_size, e.g. "
                          "--set model.vocab_size=8192; a run derives it from its tokenizer)")
    root, block = _one_block_shapes(cfg.model_dump_json())
    out = [_tensor_info(name, shape, None, cfg.tie_embeddings) for name, shape in root]
    one = [_tensor_info(name, shape, 0, cfg.tie_embeddings) for name, shape in block]
    for i in range(cfg.n_layers):
        out += [TensorInfo(f"layers.{i}.{t.name}", t.shape, i, t.matmul, t.hidden, t.expert, t.local,
                           t.local_dim0) for t in one]
    return ModelTensors(out, cfg)


@functools.lru_cache(maxsize=8)
def _one_block_shapes(model_json: str) -> tuple[tuple, tuple]:
    """((name, shape) of the embeddings, final norm and heads, (name, shape) of one block's parameters
    named within the block), from a one-block build on the meta device."""
    from lmforge.models.transformer import build_model

    one = ModelConfig.model_validate_json(model_json).model_copy(update={"n_layers": 1})
    try:
        model = build_model(one, device="meta")
    except (RuntimeError, ValueError, OverflowError) as e:  # a shape past torch's int64 sizes
        from lmforge.errors import ConfigError

        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"the model section describes tensors torch cannot hold ({why}); lower "
                          "model.d_model, model.d_ff, model.vocab_size or model.moe.n_experts") from None
    root, block = [], []
    for name, p in model.named_parameters():
        if name.startswith("layers.0."):
            block.append((name[len("layers.0."):], tuple(p.shape)))
        else:
            root.append((name, tuple(p.shape)))
    return tuple(root), tuple(block)


def _tensor_info(name: str, shape: tuple[int, ...], block: int | None, tied: bool) -> TensorInfo:
    linear = len(shape) == 2 and not name.startswith(("tok_embeddings", "pos_embeddings"))
    expert = ".moe.experts." in f".{name}"
    matmul = linear or expert or (name == "tok_embeddings.weight" and tied)
    return _tp_split(TensorInfo(name, shape, block, matmul, linear and block is not None, expert=expert), 1,
                     tied)


# -- optimizers ------------------------------------------------------------------------------------


def optimizer_state_bytes(tensors: list[TensorInfo], optim, device_type: str = "cpu") -> int:
    """Bytes of optimizer state once every tensor has had its first update (state is created lazily
    at step 1), as the optimizer's spec says it allocates it (optim/memory.py, its OptimizerSpec.memory)."""
    state_bytes = MEMORY[optim.name].state_bytes
    return sum(state_bytes(t, optim, device_type) for t in tensors if t.trainable and t.in_optimizer)


def optimizer_step_scratch(tensors: list[TensorInfo], optim, device_type: str = "cpu") -> int:
    """Temporary bytes an optimizer step allocates beyond its state: fused Adam updates in place;
    per-tensor loops allocate about a few copies of the largest tensor."""
    sizes = [t.local for t in tensors if t.trainable and t.in_optimizer]
    if not sizes:
        return 0
    return MEMORY[optim.name].step_copies(optim) * max(sizes) * 4


# -- activations -----------------------------------------------------------------------------------


@dataclass
class ActivationProfile:
    """Saved bytes of one micro-batch on this rank and the moments of its backward."""

    saved: int  # everything saved for backward at the end of forward
    forward_extra: int  # transient at the end of forward (the logits)
    # (name, live saved bytes, gradient elements so far, transient bytes) per backward moment
    backward_points: list[tuple[str, int, int, int]]
    grad_total: int  # trainable elements on this rank
    per_block: list[int]  # saved bytes per block (as run: checkpointed blocks keep their input only)
    block_full: int  # saved bytes of one block computed without checkpointing
    stem: int  # embeddings' saved bytes
    head: int  # final norm + head + loss saved bytes
    # autocast weight copies the blocks keep, where not every block weight's is kept (a frozen base keeps
    # a copy only for an input's gradient); None: every matmul weight's
    block_copies: int | None = None


def _mask_bytes(cfg: Config, B: int, T: int, c: int, packed: bool) -> int:
    window = cfg.model.sliding_window
    if packed:
        return B * T * T * c
    if window is not None and T > window:
        return T * T * c
    return 0


def moe_rows(cfg: Config, N: int) -> int:
    """Routed rows of one MoE layer on N tokens: N * top_k, or with a capacity the balanced load's
    min(N * top_k, E * capacity) (an unbalanced router drops more)."""
    moe = cfg.model.moe
    rows = N * moe.top_k
    if moe.capacity_factor is not None:
        rows = min(rows, moe.n_experts * math.ceil(moe.capacity_factor * N * moe.top_k / moe.n_experts))
    return rows


def moe_saved(cfg: Config, N: int, precision: str, ep: int = 1, grouped: bool = False) -> int:
    """Bytes one MoE layer saves for backward on N tokens beyond its input (see the module doc);
    `grouped`: the CUDA grouped-GEMM path (no concatenated weights)."""
    from lmforge.models.moe import expert_d_ff, shared_d_ff

    m = cfg.model
    moe = m.moe
    c = 2 if precision in ("bf16", "fp16") else 4
    d, E, k = m.d_model, moe.n_experts, moe.top_k
    Fe, Fs = expert_d_ff(m), shared_d_ff(m)
    M = moe_rows(cfg, N)
    router = N * E * 4 * 2 + N * 4 + N * k * 8  # scores, logits, logsumexp, top-k indices
    if moe.norm_topk_prob:
        router += N * k * 4 + N * 4  # the chosen scores and their sum (the division)
    if moe.router_score == "sigmoid":
        router += N * 4  # the per-token sum that normalises P for the balance statistic
    routed = 2 * M * 8 + M * d * c + 4 * Fe * M * c + M * 4 + 2 * M * d * c
    if not grouped:
        routed += (E // ep) * 2 * Fe * d * c
    if ep > 1:
        routed += 2 * M * 8
    shared = 4 * Fs * N * c if Fs else 0
    if Fs and moe.shared_gate:
        shared += N * 4 + N * d * c
    return router + routed + shared


def block_saved(cfg: Config, B: int, T: int, precision: str, tp: int = 1, sp: bool = False,
                packed: bool = False, ep: int = 1, grouped: bool = False) -> int:
    """Bytes one transformer block saves for backward on micro-batch (B, T) (see the module doc)."""
    m = cfg.model
    low = precision in ("bf16", "fp16")
    c = 2 if low else 4
    d, D = m.d_model, m.resolved_head_dim
    h, hk, F = m.n_heads // tp, m.resolved_kv_heads // tp, m.resolved_d_ff // tp
    N = B * T
    n_norm = N // tp if (tp > 1 and sp) else N  # sequence parallelism: norms see 1/tp of the tokens
    norm = (2 * d + 1) * 4 if m.norm == "rmsnorm" else (d + 2) * 4
    attn_in = 3 * d * c if low else d * 4
    mlp_in = (2 if m.mlp == "swiglu" else 1) * d * c if low else d * 4
    attn = (2 * h + 2 * hk) * D * c + h * 4  # q, k, v, output, logsumexp
    if m.resolved_attention_dropout > 0:
        # SDPA with dropout runs the math kernel: q, k and v expanded to h heads, its output (wo's
        # input is then a copy), the softmax, the dropout mask (a float tensor) and the dropped
        # probabilities; no logsumexp
        attn = 4 * h * D * c + 3 * h * T * c
    mlp = (4 if m.mlp == "swiglu" else 2) * F * c
    if m.moe is not None:
        mlp = 0
        # fp32: the norm output is the router's and the shared experts' input as it is; autocast casts
        # it for the router and for each of the shared MLP's two input projections.
        mlp_in = (1 + (2 if m.moe.n_shared_experts else 0)) * d * c if low else d * 4
    total = 2 * n_norm * norm + N * (attn_in + attn + mlp_in + mlp)
    if m.moe is not None:
        total += moe_saved(cfg, N, precision, ep, grouped)
    if m.resolved_hidden_dropout > 0:
        total += 2 * n_norm * d * 4  # residual dropout masks (float, like the fp32 residual stream)
    if low and m.pos_embedding == "rope":
        total += 4 * T * D * c  # cos and sin cast for q and for k
    total += _mask_bytes(cfg, B, T, c, packed)
    return total


def selective_kept(cfg: Config, B: int, T: int, precision: str, tp: int = 1, ep: int = 1,
                   grouped: bool = False) -> int:
    """Bytes one block keeps beyond its input under activation_checkpointing=selective
    (parallel/checkpointing.py): the outputs of its matmuls in forward order (every second one with
    ac_save=alternate_matmuls), of its attention kernel (output and logsumexp; the math kernel's two
    batched matmuls with dropout) and of the router's top-k. A dense block's w_down output is never kept
    when no dropout follows it and its weight shape is unique in the block (the recompute never needs it)."""
    from lmforge.models.moe import expert_d_ff, shared_d_ff

    m = cfg.model
    c = 2 if precision in ("bf16", "fp16") else 4
    N, d, D = B * T, m.d_model, m.resolved_head_dim
    h, hk, F = m.n_heads // tp, m.resolved_kv_heads // tp, m.resolved_d_ff // tp
    mm = [N * h * D * c, N * hk * D * c, N * hk * D * c, N * d * c]  # wq, wk, wv, wo
    attn_drop = m.resolved_attention_dropout > 0
    kept = B * h * T * T * c + N * h * D * c if attn_drop else N * h * D * c + N * h * 4
    if m.moe is not None:
        E, k, Fe, Fs = m.moe.n_experts, m.moe.top_k, expert_d_ff(m), shared_d_ff(m)
        M, local = moe_rows(cfg, N), E // ep
        kept += N * k * (4 + 8)  # top-k scores (fp32) and indices
        mm.append(N * E * c)  # router logits
        # the CPU loop: one gate-and-up GEMM and one down GEMM per expert (balanced rows assumed); CUDA:
        # three grouped GEMMs over all rows
        if grouped:
            mm += [M * Fe * c, M * Fe * c, M * d * c]
            repeat = 0
        else:
            # (gate-and-up, down) per local expert: counted below without a list as long as the experts
            pair, at, repeat = (M // local * 2 * Fe * c, M // local * d * c), len(mm), local
        if Fs:
            mm += [N * Fs * c, N * Fs * c, N * d * c] + ([N * c] if m.moe.shared_gate else [])
        every = 2 if cfg.train.ac_save == "alternate_matmuls" else 1
        if not repeat:
            return kept + sum(mm[::every])
        # the list is mm[:at] + pair * repeat + mm[at:]; with every 2nd kept, the pairs keep the element
        # at at's parity and the rest of the list shifts by an even count
        pairs = repeat * (sum(pair) if every == 1 else pair[at % 2])
        return kept + sum(mm[:at][::every]) + pairs + sum(mm[at:][at % every::every])
    else:
        mm += [N * F * c] * (2 if m.mlp == "swiglu" else 1)
        w_down = (m.d_model, m.resolved_d_ff)
        shapes = [(m.n_heads * D, d), (m.resolved_kv_heads * D, d), (m.resolved_kv_heads * D, d),
                  (d, m.n_heads * D), (m.resolved_d_ff, d), w_down]
        if m.mlp == "swiglu":
            shapes.append((m.resolved_d_ff, d))
        if m.resolved_hidden_dropout > 0 or shapes.count(w_down) > 1:
            mm.append(N * d * c)
    every = 2 if cfg.train.ac_save == "alternate_matmuls" else 1
    return kept + sum(mm[::every])


def _head_saved(cfg: Config, B: int, T: int, precision: str, tp: int, sp: bool, head: str = "logits",
                frozen: bool = False, token_rows: bool = False) -> tuple[int, int, int]:
    """(saved bytes, forward transient, backward transient) of final norm + head + loss. head: logits
    (cross-entropy), logps (each row's summed log-probabilities: preference training; B counts both
    rows of each pair), score (a scalar head at each row's last token: a reward model). frozen: the
    base is frozen (adapters); token_rows: finetune.train_tokens makes the token table's rows train."""
    m, tc = cfg.model, cfg.train
    low = precision in ("bf16", "fp16")
    c = 2 if low else 4
    d, V = m.d_model, m.vocab_size
    N = B * T
    n_norm = N // tp if (tp > 1 and sp) else N
    # a frozen norm weight: its input's gradient needs x and rstd, not x * rstd
    norm = ((d + 1) * 4 if frozen else (2 * d + 1) * 4) if m.norm == "rmsnorm" else (d + 2) * 4
    saved = n_norm * norm
    if head == "score":
        # the norm's output at each row's last token (two index vectors), the score head's input and the
        # Bradley-Terry loss's log-sigmoid (input and buffer per pair)
        saved += 2 * B * 8 + B * d * c + 2 * (B // 2) * 4
        return saved, N * d * 4, 2 * N * d * 4  # the final hidden states; their gradient
    weight_grad = not frozen or token_rows  # the projection's weight takes a gradient
    table = V * d * 4 if weight_grad else 0
    if tc.loss_chunk_tokens:
        C = min(tc.loss_chunk_tokens, N)
        saved += N * d * 4 + table  # the gradients computed in forward (hidden, weight)
        # a chunk's logits and softmax are made while the previous chunk's softmax is still bound
        fwd = 3 * C * V * 4 + (C * V * c + V * d * c + C * d * c if low else 0)
        bwd = N * d * 4 + table  # backward scales copies of both
        return saved, fwd, bwd
    if weight_grad:
        saved += N * (d * c if low else d * 4)  # the head's input (its weight's gradient needs it)
    if frozen and token_rows and not low:
        saved += table  # the frozen table with the trained rows written in: a tensor of its own
    # log_softmax output and targets; then nll_loss's total weight, or the gathered positions' mask and
    # the pair loss's log-sigmoid (input and buffer per pair)
    saved += N * V * 4 + N * 8 + (4 if head == "logits" else N + 2 * (B // 2) * 4)
    fwd = N * V * c + (N * V * 4 if low else 0)  # the logits (and their fp32 copy)
    if tp > 1 and not m.tie_embeddings:
        fwd += N * math.ceil(V / tp) * c  # this rank's logit columns before the gather
    bwd = 2 * N * V * 4  # log_softmax backward: incoming gradient and its result beside the saved output
    if frozen and token_rows:
        bwd += table  # the whole table's gradient before its trained rows are taken out
    return saved, fwd, bwd


def activation_profile(cfg: Config, B: int, T: int, precision: str, device_type: str, layers: list[int],
                       first: bool, last: bool, tp: int = 1, sp: bool = False,
                       packed: bool = False, ep: int = 1, *, dense_mask: bool | None = None,
                       adapters: Adapters | None = None, head: str = "logits",
                       trainable: tuple[int, list[int]] | None = None) -> ActivationProfile:
    """Saved bytes and backward moments of one micro-batch (B, T) through this rank's `layers`.

    packed: rows of several sequences (restarting positions); dense_mask: their attention takes a
    (B, T, T) mask (None: as packed; the flex kernel takes none). adapters: a frozen base with these
    adapters (estimate_adapters). head: see _head_saved. trainable: (elements of the embeddings, final
    norm and heads, elements of each of `layers`) that take gradients (None: all of them)."""
    from lmforge.tools.estimate_adapters import frozen_block_saved

    m, tc = cfg.model, cfg.train
    low = precision in ("bf16", "fp16")
    c = 2 if low else 4
    N = B * T
    d, D = m.d_model, m.resolved_head_dim
    h, hk, F = m.n_heads // tp, m.resolved_kv_heads // tp, m.resolved_d_ff // tp
    grouped = device_type == "cuda" and precision == "bf16"
    dense = packed if dense_mask is None else dense_mask
    frozen = adapters is not None
    block_copies = None
    if frozen:
        fulls, grad, block_copies = [], adapters.token_rows, 0
        for i in layers:
            saved_i, copies_i, grad = frozen_block_saved(cfg, B, T, precision, device_type, adapters, i, grad,
                                                         _mask_bytes(cfg, B, T, c, dense))
            fulls.append(saved_i)
            block_copies += copies_i
    else:
        fulls = [block_saved(cfg, B, T, precision, tp, sp, dense, ep, grouped)] * len(layers)
    n_res = N // tp if (tp > 1 and sp) else N
    ac = tc.activation_checkpointing
    # a checkpointed block keeps its input (the fp32 residual stream); a selective one also the outputs
    # of its expensive ops
    kept = n_res * d * 4
    if ac == "selective":
        kept += selective_kept(cfg, B, T, precision, tp, ep, grouped)
    per_block = []
    for i, full in zip(layers, fulls):
        checkpointed = ac in ("full", "selective") or (ac == "every_k" and i % tc.ac_every == 0)
        per_block.append(kept if checkpointed else full)
    table_grad = first and (not frozen or adapters.token_rows)  # the embedding takes a gradient
    stem = N * 8 if table_grad else 0  # token ids (embedding backward)
    if first and m.resolved_hidden_dropout > 0:
        stem += N * d * 4  # embedding dropout mask
    if first and packed and m.pos_embedding == "rope":
        stem += 2 * N * D * 4  # cos and sin gathered at the rows' own positions, shared by all blocks
    head_saved, fwd_extra, head_bwd = (_head_saved(cfg, B, T, precision, tp, sp, head, frozen,
                                                   frozen and adapters.token_rows) if last else (0, 0, 0))
    saved = stem + sum(per_block) + head_saved
    # A block's backward: the MLP's product backward holds its incoming gradient and both results
    # (3 N F) where only its saved output was (N F); attention's gradients for q, k, v and output.
    mlp_extra = (2 if m.mlp == "swiglu" else 1) * N * F * c
    if m.moe is not None:
        # one expert's product backward at a time (balanced: M / E rows), beside the gradients of the
        # routed rows and of the expert outputs (M x d each)
        from lmforge.models.moe import expert_d_ff

        M = moe_rows(cfg, N)
        mlp_extra = 2 * (M // m.moe.n_experts) * expert_d_ff(m) * c + 2 * M * d * 4
    attn_extra = (2 * h + 2 * hk) * D * N * c
    block_extra = max(mlp_extra, attn_extra) + 2 * n_res * d * 4  # + residual stream gradients
    points = []
    if trainable is None:
        root_params = _root_params(cfg, tp, first, last)
        block_params = [_block_params(cfg, tp, ep)] * len(layers)
    else:
        root_params, block_params = trainable
    grads_total = root_params + sum(block_params)
    if last:
        points.append(("loss and head", saved, 0, head_bwd))
    grads = root_params if last else 0
    below = stem + sum(per_block)
    for k in range(len(layers) - 1, -1, -1):
        below -= per_block[k]
        live = below + fulls[k]  # a checkpointed block is recomputed whole first
        points.append((f"block {layers[k]}", live, grads, block_extra))
        grads += block_params[k]
    if table_grad:
        table = m.vocab_size * d * 4 // (1 if m.tie_embeddings else tp)
        # a tied table's (or a table with trained rows') whole gradient, before it is added in
        points.append(("embeddings", stem, grads_total, table if (m.tie_embeddings or frozen) else 0))
    return ActivationProfile(saved, fwd_extra, points, grads_total, per_block, max(fulls, default=0), stem,
                             head_saved, block_copies)


def _block_params(cfg: Config, tp: int, ep: int = 1) -> int:
    m = cfg.model
    d, D, F = m.d_model, m.resolved_head_dim, m.resolved_d_ff
    attn = d * (m.n_heads + 2 * m.resolved_kv_heads) * D + m.n_heads * D * d
    mlp = (3 if m.mlp == "swiglu" else 2) * d * F
    if m.moe is not None:
        from lmforge.models.moe import expert_d_ff, shared_d_ff

        E = m.moe.n_experts
        mlp = E * d + 3 * (E // ep) * expert_d_ff(m) * d + 3 * shared_d_ff(m) * d + d * m.moe.shared_gate
    return (attn + mlp) // tp + 2 * d


def _root_params(cfg: Config, tp: int, first: bool, last: bool) -> int:
    m = cfg.model
    n = 0
    if first:
        n += m.vocab_size * m.d_model // (1 if m.tie_embeddings else tp)
    if last:
        n += m.d_model + (0 if m.tie_embeddings else m.vocab_size * m.d_model // tp)
    return n
