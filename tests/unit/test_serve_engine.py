"""The serving engine without HTTP: continuous batching gives every request the tokens it gets alone
(greedy: lmforge.eval.generate's), through prompts that join mid-batch, a queue longer than the batch,
and the window moves of the batch cache; seeded sampling does not depend on the batch; stop strings,
stop tokens, max_tokens, cancellation and bad prompts."""

from __future__ import annotations

import threading

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.eval.generate import generate
from lmforge.models import Transformer
from lmforge.serve.engine import Engine, SamplingParams, _held_back

V = 61


@pytest.fixture(autouse=True)
def one_thread():
    """Steps of this size lose more to thread synchronisation than they gain on a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(**kw) -> Transformer:
    """Random weights with an untied head: greedy continuations differ from prompt to prompt and do
    not just repeat the last token."""
    torch.manual_seed(0)
    base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=24,
                tie_embeddings=False, init_std=0.1)
    return Transformer(ModelConfig(**{**base, **kw})).eval()


def text(ids) -> str:
    """One character per token id: the text says exactly which tokens were generated."""
    return "".join(chr(0x100 + t) for t in ids)


class Collect:
    """The events of one request, per choice."""

    def __init__(self) -> None:
        self.deltas: dict[int, list[str]] = {}
        self.finish: dict[int, str] = {}
        self.tokens: dict[int, int] = {}

    def __call__(self, ev) -> None:
        assert ev.error is None, ev.error
        assert ev.index not in self.finish, "an event after the choice finished"
        self.deltas.setdefault(ev.index, []).append(ev.text)
        self.tokens[ev.index] = ev.tokens
        if ev.finish_reason is not None:
            self.finish[ev.index] = ev.finish_reason

    def text(self, i: int = 0) -> str:
        return "".join(self.deltas.get(i, []))


def drive(engine: Engine, limit: int = 1000) -> None:
    for _ in range(limit):
        if not engine.step():
            return
    raise AssertionError("the engine did not finish")


def test_continuous_batching_equals_each_request_alone():
    m = tiny()
    engine = Engine(m, text, max_batch_size=3)
    moves = []
    move = engine._move
    engine._move = lambda new_off: (moves.append(new_off - engine.off), move(new_off))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (3, 15, 5, 1, 9, 12, 2)]
    budgets = [20, 8, 18, 22, 14, 11, 21]
    got = [Collect() for _ in prompts]
    greedy = lambda k: SamplingParams(max_tokens=budgets[k], temperature=0.0)  # noqa: E731
    engine.submit([prompts[0]], greedy(0), got[0])
    for _ in range(4):
        engine.step()
    # A prompt longer than everything cached so far joins mid-batch (the window moves right) ...
    engine.submit([prompts[1]], greedy(1), got[1])
    engine.step()
    engine.step()
    # ... then more requests than free slots: they wait and join as rows finish.
    for k in range(2, len(prompts)):
        engine.submit([prompts[k]], greedy(k), got[k])
    drive(engine)
    assert engine.peak_batch == 3 and not engine.rows
    assert any(s > 0 for s in moves) and any(s < 0 for s in moves)  # both window moves happened
    for k, p in enumerate(prompts):
        want = generate(m, p, budgets[k], temperature=0.0)[0]
        assert got[k].text() == text(want), k
        assert got[k].finish == {0: "length"} and got[k].tokens == {0: len(want)}


def test_seeded_sampling_does_not_depend_on_the_batch():
    m = tiny()
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=20, seed=7, n=3)
    alone = Engine(m, text, max_batch_size=4)
    a = Collect()
    alone.submit([[5, 6, 7]], params, a)
    drive(alone)
    busy = Engine(m, text, max_batch_size=4)
    b, other = Collect(), Collect()
    busy.submit([[1, 2, 3, 4, 5, 6]], SamplingParams(max_tokens=15, temperature=1.0, seed=1), other)
    busy.step()
    busy.submit([[5, 6, 7]], params, b)
    drive(busy)
    assert busy.peak_batch == 4
    assert [b.text(i) for i in range(3)] == [a.text(i) for i in range(3)]
    assert len({a.text(i) for i in range(3)}) == 3  # the choices draw differently
    # choice j of seed s is choice 0 of seed s + j
    c = Collect()
    alone.submit([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=20, seed=9), c)
    drive(alone)
    assert c.text() == a.text(2)


def test_stop_string_cuts_the_text_and_is_never_streamed():
    m = tiny()
    prompt = [3, 1, 4, 1, 5]
    full = text(generate(m, prompt, 15, temperature=0.0)[0])
    stop = full[6:8]
    cut = full.find(stop)
    engine = Engine(m, text)
    got = Collect()
    engine.submit([prompt], SamplingParams(max_tokens=15, temperature=0.0, stop=(stop, "\u4e00")), got)
    drive(engine)
    assert got.text() == full[:cut] and got.finish == {0: "stop"}
    assert got.tokens[0] == cut + 2  # the tokens up to the one that completed the stop string
    # A stop string whose first character appears but which never completes: held back, then sent.
    never = full[4] + "\u4e00"
    got = Collect()
    engine.submit([prompt], SamplingParams(max_tokens=15, temperature=0.0, stop=(never,)), got)
    drive(engine)
    assert got.text() == full and got.finish == {0: "length"}
    assert all(not d.endswith(full[4]) for d in got.deltas[0][:-1])


def test_stop_token_ends_the_reply_outside_its_text():
    m = tiny()
    prompt = [9, 8, 7]
    toks = generate(m, prompt, 10, temperature=0.0)[0]
    stop = toks[3]
    first = toks.index(stop)
    engine = Engine(m, text)
    got = Collect()
    engine.submit([prompt], SamplingParams(max_tokens=10, temperature=0.0, stop_ids=frozenset({stop})), got)
    drive(engine)
    assert got.text() == text(toks[:first]) and got.finish == {0: "stop"} and got.tokens[0] == first + 1


def test_context_caps_max_tokens_and_cancel_frees_the_slot():
    m = tiny()
    engine = Engine(m, text, max_batch_size=2)
    got = Collect()
    engine.submit([list(range(20))], SamplingParams(max_tokens=100, temperature=0.0), got)
    drive(engine)
    assert got.tokens[0] == 4 and got.finish == {0: "length"}  # 20 + 4 = max_seq_len
    kept, gone = Collect(), Collect()
    handle = engine.submit([[1, 2]], SamplingParams(max_tokens=20, temperature=0.0), gone)
    engine.submit([[3, 4]], SamplingParams(max_tokens=6, temperature=0.0), kept)
    engine.step()
    engine.step()
    handle.cancel()
    drive(engine)
    assert 0 not in gone.finish and kept.finish == {0: "length"}
    assert kept.text() == text(generate(m, [3, 4], 6, temperature=0.0)[0])


def test_bad_prompts_are_refused():
    engine = Engine(tiny(), text)
    with pytest.raises(LmforgeError, match="room to reply"):
        engine.submit([list(range(24))], SamplingParams(), print)
    with pytest.raises(LmforgeError, match="at least one token"):
        engine.submit([[]], SamplingParams(), print)
    with pytest.raises(LmforgeError, match=r"\[0, 61\)"):
        engine.submit([[1, 61]], SamplingParams(), print)


def test_engine_thread_serves_concurrent_callers():
    m = tiny()
    prompts = [[i, i + 1, i + 2] for i in range(6)]
    results = {}
    with Engine(m, text, max_batch_size=4) as engine:
        def call(k):
            params = SamplingParams(max_tokens=10, temperature=0.0)
            results[k] = engine.generate([prompts[k]], params, timeout=60)

        threads = [threading.Thread(target=call, args=(k,)) for k in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for k, p in enumerate(prompts):
        want = generate(m, p, 10, temperature=0.0)[0]
        assert results[k] == [(text(want), 10, "length")]


def test_held_back_text():
    assert _held_back("abc", ()) == 0
    assert _held_back("ab\ufffd", ()) == 1
    assert _held_back("xx<|e", ("<|end|>",)) == 3
    assert _held_back("xx<|e", ("<|end|>", "e")) == 3
    assert _held_back("abc", ("cd", "bcx")) == 2
