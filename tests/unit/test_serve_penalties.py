"""`logit_bias`, `presence_penalty` and `frequency_penalty` in the serving engine, against a reference
loop that recomputes the whole sequence each step and applies OpenAI's definitions
(logit[j] += bias[j]; logit[j] -= count[j] * frequency + (count[j] > 0) * presence, counts over the
choice's generated tokens): greedy and seeded replies equal the reference, in a batch beside requests
without them (whose replies stay bit for bit what they are alone); the HTTP fields validate."""

from __future__ import annotations

import threading

import pytest
import torch
from pydantic import ValidationError

from lmforge.config import ModelConfig
from lmforge.models import Transformer
from lmforge.models.generation import sample_next
from lmforge.serve.engine import Engine, SamplingParams
from lmforge.serve.protocol import ChatCompletionRequest, CompletionRequest

V = 61


def tiny() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                   max_seq_len=48, tie_embeddings=False, init_std=0.1)).eval()


def text(ids) -> str:
    return "".join(chr(0x100 + t) for t in ids)


@torch.no_grad()
def reference(model, prompt: list[int], n: int, bias=(), presence=0.0, frequency=0.0, temperature=0.0,
              seed=None) -> list[int]:
    gen = None
    if temperature > 0:
        gen = torch.Generator().manual_seed(seed)
    seq, out = list(prompt), []
    counts = torch.zeros(V)
    for _ in range(n):
        logits = model(torch.tensor([seq]))[:, -1].clone()  # (1, V)
        for t, b in bias:
            logits[0, t] += b
        logits[0] -= counts * frequency + (counts > 0) * presence
        tok = int(logits.argmax(-1)) if temperature == 0 else int(sample_next(logits, temperature, None, 1.0,
                                                                              gen)[0])
        out.append(tok)
        counts[tok] += 1
        seq.append(tok)
    return out


def run(engine: Engine, prompt: list[int], params: SamplingParams) -> str:
    return engine.generate([prompt], params, timeout=60)[0][0]


@pytest.fixture(scope="module")
def model():
    return tiny()


PROMPT = [3, 14, 15, 9, 26]


@pytest.mark.parametrize("kw", [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 2.0},
    {"presence_penalty": -0.5, "frequency_penalty": 0.7},
    {"logit_bias": ((7, 100.0),)},
    {"logit_bias": ((7, 5.0), (11, -100.0)), "frequency_penalty": 1.0},
])
@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.9, 123)])
def test_engine_equals_the_reference_loop(model, kw, temperature, seed):
    bias = kw.get("logit_bias", ())
    want = reference(model, PROMPT, 20, bias, kw.get("presence_penalty", 0.0),
                     kw.get("frequency_penalty", 0.0), temperature, seed)
    free = SamplingParams(max_tokens=20, temperature=0.0)
    with Engine(model, text, max_batch_size=4) as engine:
        alone = run(engine, [5, 6, 7], free)
        got, done = [], threading.Event()

        def collect(ev):
            got.append(ev.text)
            if ev.finish_reason is not None:
                done.set()

        # the adjusted request and a plain one decode in the same batch
        params = SamplingParams(max_tokens=20, temperature=temperature, seed=seed, **kw)
        engine.submit([PROMPT], params, collect)
        run_free = run(engine, [5, 6, 7], free)
        assert done.wait(60)
    assert "".join(got) == text(want)
    assert run_free == alone


def test_penalties_change_the_reply(model):
    """The tests above would pass if nothing were applied and the reference were wrong the same way:
    the penalised greedy reply differs from the plain one, which repeats tokens."""
    plain = reference(model, PROMPT, 20)
    assert len(set(plain)) < len(plain)
    assert reference(model, PROMPT, 20, frequency=2.0) != plain
    assert reference(model, PROMPT, 20, bias=((7, 100.0),)) == [7] * 20


BASE = {"model": "m", "prompt": "x"}


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("presence_penalty", True),
    ("logit_bias", {"x": 1}), ("logit_bias", {"1": 101}), ("logit_bias", {"-1": 1}),
    ("logit_bias", {str(i): 1 for i in range(301)}), ("logit_bias", {"1": True}),
])
def test_bad_values_are_refused_naming_the_field(field, value):
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    for model, base in ((CompletionRequest, BASE), (ChatCompletionRequest, chat)):
        with pytest.raises(ValidationError) as e:
            model.model_validate({**base, field: value})
        assert e.value.errors()[0]["loc"][0] == field


def test_good_values_parse():
    r = CompletionRequest.model_validate({**BASE, "logit_bias": {"7": 100, "11": -5.5},
                                          "presence_penalty": 0.5, "frequency_penalty": -2})
    assert r.bias_pairs() == ((7, 100.0), (11, -5.5)) and r.frequency_penalty == -2.0
