"""Generation from the encoder-decoder (models/t5.py): the encoder runs once over the (padded) inputs, the
decoder one token per step through its cache (self-attention keys/values grow by one position, the
cross-attention's are projected from the encoder output once), from `decoder_start_token_id`, with the
decoder's filtering and sampling (models/generation.py), so greedy output equals transformers' generate."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmforge.errors import LmforgeError
from lmforge.models.generation import sample_next


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int,
    stops: set[int] | frozenset[int],
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Continue each row of input_ids (B, S) (attention_mask: 1 for tokens, 0 for padding) for at most
    max_new_tokens tokens; a row ends at its first token in `stops` (kept). Returns the new tokens per
    row, without the start token. temperature 0: greedy."""
    if max_new_tokens < 1:
        raise LmforgeError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if max_new_tokens > model.cfg.max_seq_len:
        raise LmforgeError(f"max_new_tokens={max_new_tokens} exceeds the decoder's model.max_seq_len="
                           f"{model.cfg.max_seq_len}")
    was_training = model.training
    model.eval()
    try:
        enc = model.encode(input_ids, attention_mask)  # (B, S, d_model): once per generation
        cache = model.new_cache(enc, attention_mask)
        B = input_ids.size(0)
        start = model.cfg.decoder_start_token_id
        step = torch.full((B, 1), start, dtype=torch.long, device=input_ids.device)
        out: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        for _ in range(max_new_tokens):
            logits = model.decode(step, enc, cache=cache)[:, -1]  # (B, vocab)
            nxt = sample_next(logits, temperature, top_k, top_p, generator)  # (B,)
            for b, tok in enumerate(nxt.tolist()):
                if not done[b]:
                    out[b].append(tok)
                    done[b] = tok in stops
            if all(done):
                break
            # finished rows keep feeding the start (= padding) token, as transformers does; unread
            step = torch.where(torch.tensor(done, device=nxt.device), start, nxt)[:, None]
        return out
    finally:
        model.train(was_training)


def check_text_options(*, chat: bool, draft, quantized: bool) -> None:
    """Refuse the generation options of the decoder-only path that an encoder-decoder does not have yet.
    `chat` is not one: the prompt as a user's turn is the encoder's input text, as seq2seq fine-tuning
    reads a chat record (data/seq2seq_data.py), with no chat template."""
    options = (("--draft", draft is not None), ("--quantized", quantized))
    asked = [name for name, on in options if on]
    if asked:
        raise LmforgeError(f"{', '.join(asked)}: not available for an encoder-decoder (model.arch=t5), which "
                           "generates from its input text with --prompt (--chat reads it the same way; "
                           "speculative decoding and quantized serving are for decoder models)")


def text_to_text(model, tokenizer, prompt: str, *, max_new_tokens: int, temperature: float,
                  top_k: int | None, top_p: float | None, num_samples: int, seed: int,
                  device: torch.device | str) -> list[str]:
    """`lmforge generate` on an encoder-decoder: the prompt is the encoder's input (its tokens then EOS,
    as T5's tokenizer encodes), each sample the decoder's output text without the stop token. Samples run
    as one batch from one generator seeded with `seed`."""
    if not prompt:
        raise LmforgeError("an encoder-decoder (model.arch=t5) generates from an input text: set "
                           "generate.prompt (--prompt)")
    eos = tokenizer.eos_id
    ids = tokenizer.encode(prompt) + [eos]
    if len(ids) > model.cfg.max_seq_len:
        raise LmforgeError(f"the prompt of {len(ids)} tokens exceeds the encoder's model.max_seq_len="
                           f"{model.cfg.max_seq_len}; shorten it")
    steps = min(max_new_tokens, model.cfg.max_seq_len)
    rows = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    outs = generate(model, rows, max_new_tokens=steps, stops={eos}, temperature=temperature, top_k=top_k,
                    top_p=top_p, generator=gen)
    return [tokenizer.decode([t for t in out if t != eos]) for out in outs]


def pad_inputs(rows: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) (B, max len) of right-padded token rows: T5 has relative positions
    only, so the side of the padding changes nothing once masked."""
    if not rows or any(len(r) == 0 for r in rows):
        raise LmforgeError("every input to the encoder needs at least one token")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids, mask
