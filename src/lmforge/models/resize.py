"""Growing the vocabulary of a trained model (a chat template's control tokens) and giving new
tokens sensible rows.

A new token's input and output rows start at the mean of the trained rows (Hewitt 2021): its
embedding then looks like an average token, and its logit is the average logit, so the model's
predictions do not change until it learns the token (a random row could dominate the softmax, a zero
output row would give it logit 0, far above the typical token's)."""

from __future__ import annotations

import torch
from torch import nn

from lmforge.models.transformer import Transformer


@torch.no_grad()
def resize_vocab(model: Transformer, vocab_size: int) -> Transformer:
    """`model` with room for `vocab_size` ids (never fewer than it has); existing rows are kept, new
    ones are zero until `init_token_rows` fills them. Updates `model.cfg.vocab_size`."""
    old = model.cfg.vocab_size
    if vocab_size <= old:
        return model
    emb = model.tok_embeddings
    grown = nn.Embedding(vocab_size, emb.embedding_dim, device=emb.weight.device, dtype=emb.weight.dtype)
    grown.weight.zero_()
    grown.weight[:old] = emb.weight
    grown.weight.requires_grad_(emb.weight.requires_grad)
    model.tok_embeddings = grown
    if not model.cfg.tie_embeddings:
        out = model.output
        new_out = nn.Linear(
            out.in_features, vocab_size, bias=False, device=out.weight.device, dtype=out.weight.dtype
        )
        new_out.weight.zero_()
        new_out.weight[:old] = out.weight
        new_out.weight.requires_grad_(out.weight.requires_grad)
        model.output = new_out
    model.cfg = model.cfg.model_copy(update={"vocab_size": vocab_size})
    return model


@torch.no_grad()
def init_token_rows(model: Transformer, ids: list[int], trained_rows: int) -> None:
    """Set the input (and untied output) rows of `ids` to the mean of rows [0, trained_rows)."""
    if not ids:
        return
    index = torch.as_tensor(ids, device=model.tok_embeddings.weight.device)
    weights = [model.tok_embeddings.weight]
    if not model.cfg.tie_embeddings:
        weights.append(model.output.weight)
    for w in weights:
        w[index] = w[:trained_rows].float().mean(0).to(w.dtype)
