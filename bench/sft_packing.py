"""SFT packing vs padding: time to train on every conversation once, on a long-tailed length mix.

    .venv/bin/python bench/sft_packing.py            # ~2 minutes on 2 idle cores
    .venv/bin/python bench/sft_packing.py --quick    # ~20 s (a busy machine: several times longer)
    .venv/bin/python bench/sft_packing.py --conversations 4000 --rounds 5 --json /tmp/sft_packing.json

Data: each conversation gets a target length drawn from a log-normal (median seq_len / 6, sigma 0.9,
capped at seq_len). It is built from `lmforge.data.instruct_tasks.generate` records (difficulty 1-4):
one task turn when that already reaches the target (the short conversations, at their natural length),
else a multi-turn conversation of task turns whose assistant replies carry a few words of explanation,
cut to the target length. Conversations are rendered with lmforge's ChatML template, tokenized by a
byte-level BPE trained here on them (vocab --vocab) and labelled by `lmforge.data.sft.label_mask`
(loss on the assistant turns), then put in `SFTSplit.of([...])`: the real SFT data path, minus files.

Training: a small lmforge Transformer (d_model 128, 4 layers, 4 heads, SwiGLU, RoPE; --d-model,
--layers), fp32 on CPU, AdamW (fused=False), `lmforge.engine.step.train_step` with the `SFT()`
objective, one micro-batch of --batch-size rows per optimizer step. The two sides see the same
conversations through `ChatLoader(split, seq_len, batch_size, packing=..., seed=0, drop_last=False)`:
  packed  best-fit-decreasing rows of seq_len tokens (several conversations per row, attention kept
          within each by segment ids, positions restarting), batch_size rows per step
  padded  one conversation per row, each batch padded to its longest conversation
The user-visible quantity is the time to train once over all conversations (one loader epoch,
batches and collation included), so both sides use the same micro-batch size in rows and the packed
side needs fewer steps. Each side has its own model and optimizer from the same init.

Method: --warmup steps per side, then --rounds rounds of one epoch per side (a fresh loader each
round, so the same batches every time), the order alternating every round; medians. Reported per
side: rows, optimizer steps per epoch, padding fraction (pad positions / all positions), epoch seconds,
real (non-pad) tokens/s, and the speed-up = padded epoch time / packed epoch time (from the medians,
and the median of the per-round ratios). Never asserts. With 2 threads, any other process on the two
cores slows every step by a varying factor (rounds of the same side differed 5x at load average 5):
check loadavg_at_start, or use --threads 1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from lmforge.config.schema import ModelConfig
from lmforge.data.chat import Conversation
from lmforge.data.chat_loader import ChatLoader
from lmforge.data.chat_template import CHATML_TOKENS, ChatTemplate
from lmforge.data.instruct_tasks import LETTERS, generate
from lmforge.data.sft import Example, SFTSplit, label_mask
from lmforge.data.tokenizer import Tokenizer
from lmforge.engine.objectives import SFT
from lmforge.engine.precision import Precision
from lmforge.engine.step import train_step
from lmforge.models import build_model
from machine import machine_info, print_markdown_table  # bench/machine.py (on sys.path)

SIDES = ("packed", "padded")
FILLER = ["so", "the", "answer", "is", "because", "we", "count", "each", "step", "first", "then",
          "check", "it", "again", "and", "that", "gives", "this", "result", "here"]


def task_turns(n: int, seed: int) -> list[list[dict]]:
    """`n` single-turn task conversations, difficulties 1-4 interleaved."""
    per = -(-n // 4)
    records = [generate(None, per, seed + d, difficulty=d) for d in (1, 2, 3, 4)]
    mixed = [r["messages"] for group in zip(*records) for r in group]
    return mixed[:n]


def explanation(rng: random.Random) -> str:
    words = [rng.choice(FILLER) if rng.random() < 0.7 else "".join(rng.choices(LETTERS, k=rng.randint(2, 7)))
             for _ in range(rng.randint(4, 30))]
    return " ".join(words) + "."


def make_examples(n: int, seq_len: int, vocab: int, seed: int) -> tuple[list[Example], dict]:
    """`n` labelled conversations whose lengths follow the capped log-normal; and how they were made."""
    rng = random.Random(seed)
    targets = np.minimum(
        np.random.default_rng(seed).lognormal(np.log(seq_len / 6), 0.9, size=n), seq_len
    ).astype(int)
    pool = task_turns(4 * n, seed)
    template = ChatTemplate.chatml()
    texts = [m["content"] for turn in pool[:4000] for m in turn]  # contents: the control tokens are added
    texts += [explanation(rng) for _ in range(2000)]
    tok = Tokenizer.train(texts, vocab_size=vocab - len(CHATML_TOKENS))
    tok.add_special_tokens(CHATML_TOKENS)
    def tokens(messages: list[dict]) -> int:
        return len(label_mask(Conversation(tuple(messages), "bench"), template, tok, loss_on="assistant").ids)

    turn_tokens = [tokens(m) for m in pool]

    examples, single, cut = [], 0, 0
    k = 0
    for target in targets:
        messages = list(pool[k % len(pool)])
        est = turn_tokens[k % len(pool)]
        k += 1
        while est < target:  # a multi-turn conversation: more task turns with explained answers
            user, assistant = pool[k % len(pool)]
            reply = f"{assistant['content']}. {explanation(rng)}"
            messages += [user, {"role": "assistant", "content": reply}]
            est += tokens([user, {"role": "assistant", "content": reply}])
            k += 1
        ex = label_mask(Conversation(tuple(messages), "bench"), template, tok, loss_on="assistant")
        if len(messages) == 2:
            single += 1
        elif len(ex.ids) > target:
            ex, cut = Example(ex.ids[:target], ex.mask[:target]), cut + 1
        if len(ex.ids) > seq_len:  # a single task turn longer than seq_len (not at these settings)
            ex = Example(ex.ids[:seq_len], ex.mask[:seq_len])
        if ex.mask[1:].any():  # what sft.fit keeps: a conversation with a loss token
            examples.append(ex)
    how = dict(single_turn=single, multi_turn=len(targets) - single, cut_to_target=cut,
               dropped_no_loss=len(targets) - len(examples), vocab=tok.vocab_size)
    return examples, how


def length_stats(split: SFTSplit) -> dict:
    lens = split.lengths
    loss = int(split.mask.sum())
    return dict(conversations=len(split), tokens=int(lens.sum()), loss_tokens=loss,
                loss_fraction=loss / max(int(lens.sum()), 1), min=int(lens.min()),
                median=float(np.median(lens)), mean=float(lens.mean()), p90=float(np.percentile(lens, 90)),
                p99=float(np.percentile(lens, 99)), max=int(lens.max()))


def model_config(args, vocab: int) -> ModelConfig:
    return ModelConfig(vocab_size=-(-vocab // 64) * 64, d_model=args.d_model, n_layers=args.layers,
                       n_heads=args.heads, max_seq_len=args.seq_len, tie_embeddings=False, dropout=0.0)


def epoch_geometry(loader: ChatLoader) -> dict:
    """Rows, steps and padding of one epoch, from collating its batches (untimed)."""
    positions = real = rows = 0
    for _ in range(loader.batches_per_epoch):
        b = loader.next_batch()
        positions += b.input_ids.numel()
        real += b.real_tokens
        rows += b.input_ids.size(0)
    return dict(steps=loader.batches_per_epoch, rows=rows, positions=positions, real_tokens=real,
                padding_fraction=1 - real / positions)


def run(args) -> dict:
    t0 = time.perf_counter()
    examples, how = make_examples(args.conversations, args.seq_len, args.vocab, args.seed)
    split = SFTSplit.of(examples)
    stats = length_stats(split)
    data_s = time.perf_counter() - t0
    cfg = model_config(args, how["vocab"])
    device = torch.device("cpu")
    precision = Precision("fp32", device)
    objective = SFT()

    def loader(side: str) -> ChatLoader:
        return ChatLoader(split, args.seq_len, args.batch_size, packing=side == "packed", seed=0,
                          drop_last=False)

    geometry = {s: epoch_geometry(loader(s)) for s in SIDES}
    torch.manual_seed(0)
    first = build_model(cfg, device)
    models, opts = {}, {}
    for s in SIDES:
        models[s] = build_model(cfg, device)
        models[s].load_state_dict(first.state_dict())
        models[s].train()
        opts[s] = torch.optim.AdamW(models[s].parameters(), lr=3e-4, weight_decay=0.0, fused=False)

    def epoch(side: str, max_steps: int | None = None) -> tuple[float, float]:
        """(seconds, mean loss) of one pass of a fresh loader (or its first max_steps batches)."""
        ld = loader(side)
        steps = ld.batches_per_epoch if max_steps is None else min(max_steps, ld.batches_per_epoch)
        losses = []
        t = time.perf_counter()
        for _ in range(steps):
            batch = ld.next_batch()
            losses.append(train_step(models[side], [batch], opts[side], precision, objective=objective).loss)
        return time.perf_counter() - t, statistics.fmean(losses)

    for s in SIDES:
        epoch(s, args.warmup)
    times: dict[str, list[float]] = {s: [] for s in SIDES}
    losses: dict[str, list[float]] = {s: [] for s in SIDES}
    for r in range(args.rounds):
        for s in SIDES if r % 2 == 0 else SIDES[::-1]:
            dt, loss = epoch(s)
            times[s].append(dt)
            losses[s].append(loss)
            print(f"  round {r + 1}/{args.rounds} {s}: {dt:.1f} s ({geometry[s]['steps']} steps, "
                  f"mean loss {loss:.3f})", flush=True)
    res = dict(data=stats, made=how, data_s=data_s, seq_len=args.seq_len, batch_size=args.batch_size,
               model=dict(d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                          vocab=cfg.vocab_size, params=sum(p.numel() for p in first.parameters())),
               rounds=args.rounds, warmup=args.warmup, sides={})
    for s in SIDES:
        med = statistics.median(times[s])
        g = geometry[s]
        res["sides"][s] = dict(**g, epoch_s=med, raw_epoch_s=times[s], losses=losses[s],
                               real_tokens_per_s=g["real_tokens"] / med, positions_per_s=g["positions"] / med,
                               ms_per_step=1e3 * med / g["steps"])
    res["speedup"] = res["sides"]["padded"]["epoch_s"] / res["sides"]["packed"]["epoch_s"]
    per_round = sorted(p / q for p, q in zip(times["padded"], times["packed"]))
    res["speedup_per_round_min_max"] = [per_round[0], per_round[-1]]
    res["speedup_per_round_median"] = statistics.median(per_round)
    return res


def print_tables(res: dict) -> None:
    d, m = res["data"], res["made"]
    print(f"\n{d['conversations']:,} conversations ({m['single_turn']:,} single-turn tasks, "
          f"{m['multi_turn']:,} "
          f"multi-turn, {m['cut_to_target']:,} cut to their target length; made in {res['data_s']:.1f} s), "
          f"{d['tokens']:,} tokens, {d['loss_fraction']:.0%} of them loss tokens")
    print_markdown_table(
        ["seq_len", "min", "median", "mean", "p90", "p99", "max"],
        [[str(res["seq_len"]), str(d["min"]), f"{d['median']:.0f}", f"{d['mean']:.1f}", f"{d['p90']:.0f}",
          f"{d['p99']:.0f}", str(d["max"])]],
    )
    mdl = res["model"]
    print(f"\nmodel: d_model {mdl['d_model']}, {mdl['n_layers']} layers, {mdl['n_heads']} heads, vocab "
          f"{mdl['vocab']}, {mdl['params'] / 1e6:.2f}M params; micro-batch {res['batch_size']} rows; "
          f"{res['rounds']} interleaved rounds, medians")
    rows = []
    for s, v in res["sides"].items():
        rows.append([s, f"{v['rows']:,}", f"{v['steps']:,}", f"{v['padding_fraction']:.1%}",
                     f"{v['positions']:,}", f"{v['ms_per_step']:.0f}", f"{v['epoch_s']:.1f}",
                     f"{v['real_tokens_per_s']:,.0f}", f"{v['positions_per_s']:,.0f}"])
    print_markdown_table(["side", "rows", "steps/epoch", "padding", "positions", "ms/step", "epoch s",
                          "real tok/s", "positions/s"], rows)
    lo, hi = res["speedup_per_round_min_max"]
    print(f"\npacking speed-up (padded epoch s / packed epoch s): {res['speedup']:.2f} from the medians; "
          f"per round median {res['speedup_per_round_median']:.2f}, range {lo:.2f}-{hi:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="~20 s: 200 conversations, 2 rounds, 1 warm-up step")
    ap.add_argument("--conversations", type=int, default=None, help="default 1200 (--quick: 200)")
    ap.add_argument("--rounds", type=int, default=None, help="timed epochs per side (default 3, --quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per side (default 3, --quick 1)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8, help="rows per optimizer step, both sides")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048, help="tokenizer vocabulary (model: rounded up to 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = ap.parse_args(argv)
    args.conversations = args.conversations or (200 if args.quick else 1200)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)

    torch.set_num_threads(args.threads)
    machine = machine_info(threads=args.threads)
    print(f"machine: {machine}", flush=True)
    res = run(args)
    print_tables(res)
    if args.json:
        machine["loadavg_at_end"] = list(os.getloadavg())
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = dict(machine=machine, command=" ".join(sys.argv), results=res)
        args.json.write_text(json.dumps(out, indent=1))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
