"""The moments of a pipelined step (parallel.pp > 1) for `lmforge estimate` (tools/estimate.py): the
operations of torch.distributed.pipelining's schedules, walked one by one with what each stage holds."""

from __future__ import annotations

from lmforge.config.schema import Config
from lmforge.tools.estimate_parts import DTYPE_BYTES, activation_profile


def pipeline_ops(schedule: str, pp: int, v: int, m: int, pp_rank: int) -> list[tuple[str, int, int]]:
    """The (F or B, micro-batch, local stage) operations `pp_rank` runs in one step, in the order of
    torch.distributed.pipelining's schedules: GPipe all forwards then all backwards; 1F1B pp - rank
    warm-up forwards, then a backward and a forward in turn; interleaved 1F1B its warm-up of
    (v - 1) * mb_per_round + 2 (pp - 1 - rank) forwards, then forward + backward pairs, each local
    stage in rounds of mb_per_round micro-batches (ScheduleInterleaved1F1B's operation list)."""
    if schedule == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if schedule == "1f1b":
        warm = min(m, pp - pp_rank)
        ops = [("F", i, 0) for i in range(warm)]
        f = warm
        for b in range(m):
            ops.append(("B", b, 0))
            if f < m:
                ops.append(("F", f, 0))
                f += 1
        return ops
    per_round = m // max(1, m // pp)
    total = m * v
    warm = min((v - 1) * per_round + 2 * (pp - 1 - pp_rank), total)
    next_f, next_b = [0] * v, [0] * v
    ops = []
    for op in range(total + warm):
        if op < total:
            s = (op // per_round) % v
            ops.append(("F", next_f[s], s))
            next_f[s] += 1
        if op >= warm:
            s = v - 1 - ((op - warm) // per_round) % v
            ops.append(("B", next_b[s], s))
            next_b[s] += 1
    return ops


def pipeline_step(cfg: Config, layout, device_type: str, precision: str, pp_rank: int, grad_dev: int,
                  base: int, rows: dict[str, int], notes: list[str]) -> dict[str, int]:
    """The moments of one pipelined step on `pp_rank`, walked through its schedule's operations.

    What a stage holds (torch.distributed.pipelining's PipelineStage, measured): for every micro-batch
    between its forward and its backward, the tensors autograd saved plus, on the last stage, the
    stage output (the logits) in `fwd_cache` until that micro-batch's backward has run; a receive
    buffer per micro-batch for the activations (non-first stages) and one for the output gradients
    (non-last stages), allocated at the first step and kept; once a stage's first backward has run,
    all its gradients (they accumulate over the micro-batches). GPipe and 1F1B also keep the latest
    forward's output referenced from the schedule loop until the next forward returns. Each operation
    costs the same whatever the number of micro-batches and layers (running sums, each stage's worst
    backward moment found once)."""
    tc, pc, m_cfg = cfg.train, cfg.parallel, cfg.model
    c = DTYPE_BYTES["bf16" if precision in ("bf16", "fp16") else "fp32"]
    v = pc.pp_stages_per_rank
    n_stages = layout.pp * v
    per = m_cfg.n_layers // n_stages
    m = pc.pp_microbatches or tc.grad_accum_steps
    rows_per_mb = max(1, tc.micro_batch_size * tc.grad_accum_steps // m)
    N = rows_per_mb * cfg.seq_len
    ids = [pp_rank + k * layout.pp for k in range(v)]
    profs, held, fwd_tr, logits, lasts = [], [], [], [], []
    boundary = 0
    for sid in ids:
        first, last = sid == 0, sid == n_stages - 1
        prof = activation_profile(cfg, rows_per_mb, cfg.seq_len, precision, device_type,
                                  list(range(sid * per, (sid + 1) * per)), first, last, layout.tp,
                                  pc.sequence_parallel)
        out = N * m_cfg.vocab_size * c if last else 0
        profs.append(prof)
        held.append(prof.saved + out)
        fwd_tr.append(max(prof.forward_extra - out, 0))
        logits.append(out)
        lasts.append(last)
        boundary += ((not first) + (not last)) * m * N * m_cfg.d_model * 4
    grad_total = max(sum(p.grad_total for p in profs), 1)
    stage_grads = [p.grad_total * grad_dev // grad_total for p in profs]
    base += boundary
    if boundary:
        rows["pipeline send/recv buffers"] = boundary
    # each stage's worst backward moment beyond what is held anyway, before and after its first backward
    first_bw, later_bw, extras = [], [], []
    for prof, sg in zip(profs, stage_grads):
        points = prof.backward_points
        share = max(prof.grad_total, 1)
        first_bw.append(max(so_far * sg // share + live + extra for _, live, so_far, extra in points))
        later_bw.append(sg + max(live + extra for _, live, _, extra in points))
        extras.append(max(extra for *_, extra in points))
    inflight: dict[tuple[int, int], int] = {}
    live = 0  # sum(inflight.values())
    done = [False] * v
    grads = 0  # the gradients of the stages whose first backward has run
    prev_f: list[int | None] = [None] * v
    loop_holds = pc.pp_schedule in ("gpipe", "1f1b")
    moments: dict[str, int] = {}
    most = 0
    temp = 0
    for kind, mb, s in pipeline_ops(pc.pp_schedule, layout.pp, v, m, pp_rank):
        if kind == "F":
            stale = prev_f[s] is not None and (prev_f[s], s) not in inflight
            inflight[(mb, s)] = held[s]
            live += held[s]
            most = max(most, live)
            moments[f"forward mb {mb} stage {ids[s]}"] = (base + grads + live + fwd_tr[s]
                                                          + (logits[s] if loop_holds and stale else 0))
            temp = max(temp, fwd_tr[s])
            prev_f[s] = mb
            continue
        live -= inflight.pop((mb, s))
        mine = later_bw[s] if done[s] else first_bw[s]
        moments[f"backward mb {mb} stage {ids[s]}"] = base + grads + live + logits[s] + mine
        temp = max(temp, extras[s])
        if not done[s]:
            done[s] = True
            grads += stage_grads[s]
    if m_cfg.tie_embeddings and 0 in ids and n_stages - 1 not in ids:
        # the last stage's gradient of the tied table arrives whole before it is added to the owner's
        table = m_cfg.vocab_size * m_cfg.d_model * 4
        moments["tied embedding gradient received"] = base + grad_dev + table
    rows["activations (saved for backward)"] = most
    rows["temporaries (largest)"] = temp
    notes.append(f"pipeline {pc.pp_schedule}: {m} micro-batches of {rows_per_mb} rows; at most "
                 f"{max(1, round(most / max(held)))} in flight on this rank")
    return moments


