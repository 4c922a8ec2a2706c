"""Exact match of an encoder-decoder (model.arch=t5) on verifiable task records (`lmforge tasks` writes
them; `lmforge eval RUN --tasks FILE.jsonl`): each record's input is what seq2seq fine-tuning reads from
it (data/seq2seq_data.py: the user's turn, a system prompt before it per the run's seq2seq.system, no chat
template), its tokens then EOS; the encoder runs once per batch of padded inputs and the decoder writes
its greedy output through its cache (models/t5_generate.py), up to EOS; the output is scored against the
record's answer as a decoder's chat reply is (data/instruct_tasks.py)."""

from __future__ import annotations

from lmforge.data.instruct_tasks import accuracy_by_task
from lmforge.data.seq2seq_data import input_text
from lmforge.errors import DataError
from lmforge.models.t5_generate import generate, pad_inputs


def input_ids(tokenizer, records: list[dict], section, max_len: int) -> list[list[int]]:
    """Each record's encoder input: its input text's tokens then EOS, cut to `max_len` keeping the EOS (as
    seq2seq.overlong=truncate prepares training inputs)."""
    out = []
    for i, record in enumerate(records):
        ids = tokenizer.encode(input_text(record, f"record {i}", section))[: max_len - 1]
        out.append(ids + [tokenizer.eos_id])
    return out


def task_accuracy(run, records: list[dict], max_new_tokens: int = 24,
                  batch_size: int = 32) -> dict[str, tuple[int, int]]:
    """{task: (correct, total)} of the run's greedy outputs to `records`."""
    if batch_size < 1:
        raise DataError(f"--batch-size must be >= 1, got {batch_size}")
    model, tok = run.model, run.tokenizer
    eos = tok.eos_id
    rows = input_ids(tok, records, run.cfg.seq2seq, model.cfg.max_seq_len)
    steps = min(max_new_tokens, model.cfg.max_seq_len)
    texts: list[str] = []
    for i in range(0, len(rows), batch_size):
        ids, mask = pad_inputs(rows[i: i + batch_size], 0, device=run.device)
        for out in generate(model, ids, attention_mask=mask, max_new_tokens=steps, stops={eos}):
            texts.append(tok.decode([t for t in out if t != eos]))
    return accuracy_by_task(records, texts)
