"""Objective mlm: framing, masking statistics (80/10/10 within binomial bounds), special tokens never
picked, masks a pure function of (seed, row), the summed loss and the accuracy metric, bidirectionality,
and the refusals between encoders and causal objectives."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.config import Config, ModelConfig
from lmforge.data.batch import IGNORE_INDEX, TokenBatch
from lmforge.engine.objectives import CausalLM, MaskedLM, build_objective
from lmforge.errors import ConfigError
from lmforge.models import build_model

VOCAB = 1000
IDS = {"cls": 1, "sep": 2, "mask": 3, "pad": 4}
EOS = 0
EXTRA_SPECIAL = 999  # another special token (a chat template's, say): never picked either


class FakeTokenizer:
    eos_id = EOS
    vocab_size = VOCAB
    _names = {0: "<|endoftext|>", 1: "[CLS]", 2: "[SEP]", 3: "[MASK]", 4: "[PAD]", 999: "<x>"}

    def encoder_ids(self):
        return dict(IDS)

    def special_tokens(self):
        return list(self._names.values())

    def token_id(self, text):
        return {v: k for k, v in self._names.items()}[text]


def objective(**kw) -> MaskedLM:
    return MaskedLM(**kw).bind(FakeTokenizer())


def stream(B: int, T: int, seed: int = 0) -> TokenBatch:
    """Rows of ordinary ids with some end-of-document tokens, as the TokenLoader gives them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(5, 999, (B, T), generator=g)
    x[torch.rand(B, T, generator=g) < 0.02] = EOS
    return TokenBatch(x, torch.roll(x, -1, 1))


def test_rows_are_framed_as_bert_does():
    raw = stream(3, 16)
    framed = objective().frame(raw.input_ids)
    assert framed.shape == (3, 16)
    assert (framed[:, 0] == IDS["cls"]).all() and (framed[:, -1] == IDS["sep"]).all()
    body = raw.input_ids[:, :14]
    # end of document -> [SEP]
    assert torch.equal(framed[:, 1:-1], torch.where(body == EOS, IDS["sep"], body))


def within(count: int, n: int, p: float, z: float = 4.5) -> bool:
    """count is within z standard deviations of Binomial(n, p)'s mean."""
    return abs(count - n * p) <= z * math.sqrt(n * p * (1 - p))


def test_masking_statistics_match_80_10_10():
    obj = objective()
    batch = obj.batch_of(stream(64, 512, seed=1))
    framed = obj.frame(stream(64, 512, seed=1).input_ids)
    eligible = ~torch.isin(framed, torch.tensor([EOS, *IDS.values()]))
    picked = batch.targets != IGNORE_INDEX
    n, k = int(eligible.sum()), int(picked.sum())
    assert within(k, n, 0.15), (k, n)
    assert obj.num_targets(batch) == k
    assert torch.equal(batch.targets[picked], framed[picked])  # the target is the original token
    inputs = batch.input_ids[picked]
    masked = int((inputs == IDS["mask"]).sum())
    kept = int((inputs == framed[picked]).sum())
    randomised = k - masked - kept
    # a random replacement hits the original token with probability 1/994: counted as kept
    assert within(masked, k, 0.8) and within(kept, k, 0.1 + 0.1 / 994)
    assert within(randomised, k, 0.1 * 993 / 994)
    replaced = inputs[(inputs != IDS["mask"]) & (inputs != framed[picked])]
    assert not torch.isin(replaced, torch.tensor([EOS, EXTRA_SPECIAL, *IDS.values()])).any()
    assert (replaced < VOCAB).all()
    # positions not picked are unchanged
    assert torch.equal(batch.input_ids[~picked], framed[~picked])


def test_split_is_configurable():
    obj = objective(mask_prob=0.5, replace_prob=0.0, random_prob=1.0)
    batch = obj.batch_of(stream(16, 256, seed=2))
    picked = batch.targets != IGNORE_INDEX
    assert not (batch.input_ids == IDS["mask"]).any()
    changed = int((batch.input_ids[picked] != batch.targets[picked]).sum())
    assert changed >= int(picked.sum()) * 0.99  # all random (1/994 coincide with the original)


def test_special_tokens_are_never_picked():
    obj = objective(mask_prob=0.95)
    raw = stream(8, 128, seed=3).input_ids
    raw[:, ::3] = EXTRA_SPECIAL
    raw[:, 1::7] = EOS
    raw[0, :] = IDS["pad"]
    batch = obj.batch_of(TokenBatch(raw, raw))
    framed = obj.frame(raw)
    special = torch.isin(framed, torch.tensor([EOS, EXTRA_SPECIAL, *IDS.values()]))
    assert special.sum() > 300
    assert (batch.targets[special] == IGNORE_INDEX).all()
    assert torch.equal(batch.input_ids[special], framed[special])
    assert (batch.targets[~special] != IGNORE_INDEX).float().mean() > 0.9  # and the rest mostly picked


def test_masks_are_a_function_of_seed_and_row():
    raw = stream(6, 64, seed=4)
    a, b = objective(seed=7).batch_of(raw), objective(seed=7).batch_of(raw)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.targets, b.targets)
    c = objective(seed=8).batch_of(raw)
    assert not torch.equal(a.targets, c.targets)
    # the same row masked alone, or in another batch at another place: the same mask (layout-free,
    # so micro-batch splits, world sizes and resumes see the masks of the uninterrupted run)
    alone = objective(seed=7).batch_of(TokenBatch(raw.input_ids[4:5], raw.targets[4:5]))
    assert torch.equal(alone.targets[0], a.targets[4]) and torch.equal(alone.input_ids[0], a.input_ids[4])
    # rows that differ get different masks
    assert not torch.equal(a.targets[0] != IGNORE_INDEX, a.targets[1] != IGNORE_INDEX)


class FixedLogits(torch.nn.Module):
    """Logits that put 5.0 on `guess` at every position (and 0 elsewhere), computed for `select` only."""

    def __init__(self, guess: torch.Tensor) -> None:
        super().__init__()
        self.guess = guess

    def forward(self, ids, select=None):
        logits = torch.nn.functional.one_hot(self.guess, VOCAB).float() * 5.0  # (B, T, V)
        return logits[select]


def test_loss_is_summed_over_picked_positions_and_accuracy_counts_right_guesses():
    obj = objective()
    batch = obj.batch_of(stream(4, 64, seed=5))
    picked = batch.targets != IGNORE_INDEX
    guess = torch.where(picked, batch.targets, 5).clone()  # right everywhere it is picked...
    wrong = picked.nonzero()[:3]
    guess[wrong[:, 0], wrong[:, 1]] = 6 + (batch.targets[wrong[:, 0], wrong[:, 1]] == 6).long()  # ...but 3
    out = obj(FixedLogits(guess), batch)
    n = int(picked.sum())
    logz = math.log(math.exp(5.0) + VOCAB - 1)
    want = (n - 3) * (logz - 5.0) + 3 * logz
    assert out.loss.item() == pytest.approx(want, rel=1e-6)
    assert out.metrics["accuracy"].item() == n - 3  # summed; the step reports it per target


def encoder_cfg(**kw) -> ModelConfig:
    return ModelConfig(arch="encoder", vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=32,
                       norm="layernorm", pos_embedding="learned", mlp="gelu", bias=True, **kw)


def test_encoder_attends_both_ways():
    torch.manual_seed(0)
    model = build_model(encoder_cfg(init_std=0.3)).eval()
    ids = torch.randint(5, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    later = ids.clone()
    later[0, 12] = ids[0, 12] + 1
    with torch.no_grad():
        a, b = model(ids), model(later)
    assert (a[0, :12] - b[0, :12]).abs().amax(-1).min() > 1e-3  # every earlier position sees it
    # padding keys are not attended: changing a padded token changes no real position
    mask = torch.ones_like(ids)
    mask[0, 14:] = 0
    padded = ids.clone()
    padded[0, 15] = 7
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask)[0, :14],
                                   model(padded, attention_mask=mask)[0, :14], atol=0, rtol=0)


def test_encoder_and_objective_refuse_each_other():
    torch.manual_seed(0)
    encoder = build_model(encoder_cfg())
    decoder = build_model(ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=4, max_seq_len=32))
    with pytest.raises(ConfigError, match="model.arch=encoder"):
        objective().check_model(decoder)
    with pytest.raises(ConfigError, match="objective mlm"):
        CausalLM().check_model(encoder)
    objective().check_model(encoder)
    with pytest.raises(ValueError, match="objective mlm needs model.arch=encoder"):
        Config.model_validate({"objective": {"name": "mlm"}})
    with pytest.raises(ValueError, match="an encoder trains with objective mlm"):
        Config.model_validate({"model": encoder_cfg().model_dump()})
    with pytest.raises(ValueError, match="replace_prob"):
        Config.model_validate({"mlm": {"replace_prob": 0.95, "random_prob": 0.1}})


def test_objective_from_config_and_tokenizer_without_mask_token():
    cfg = Config.model_validate({"model": encoder_cfg().model_dump(), "objective": {"name": "mlm"},
                                 "mlm": {"mask_prob": 0.2}, "run": {"seed": 11}})
    obj = build_objective(cfg)
    assert isinstance(obj, MaskedLM) and obj.mask_prob == 0.2 and obj.seed == 11

    class Plain(FakeTokenizer):
        def encoder_ids(self):
            return None

    with pytest.raises(ConfigError, match=r"\[MASK\]"):
        obj.bind(Plain())
