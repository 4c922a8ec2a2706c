"""`lmforge serve` through the official `openai` client against a server on localhost: completions and
chat completions, streamed and not, equal to lmforge.eval.generate's greedy output; n, stop strings,
max_tokens, usage, seeded sampling, /v1/models, and concurrent requests each equal to their solo
output while the engine batches them."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from conftest import TINY, tiny_overrides
from lmforge.config import load_config
from lmforge.data.chat_template import ChatTemplate, stop_ids
from lmforge.eval.chat import chat_prompt_ids
from lmforge.eval.generate import generate
from lmforge.eval.open_run import load_run
from lmforge.train.trainer import train

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

KEY = "test-key-0123456789"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, shared_data_dir) -> Path:
    """The tiny recipe, one step at a negligible lr: near its random init, whose untied head makes
    every prompt's greedy continuation different (a trained tiny model mostly repeats newlines)."""
    root = tmp_path_factory.mktemp("serve") / "run"
    train(load_config(TINY, tiny_overrides(
        root, shared_data_dir, "train.max_steps=1", "checkpoint.every=0", "train.eval_every=0",
        "optim.lr=1e-6", "schedule.warmup_steps=0", "model.max_seq_len=128", "model.tie_embeddings=false",
        "model.init_std=0.1")))
    return root


@pytest.fixture(scope="module")
def ref(run_dir):
    return load_run(run_dir)


@pytest.fixture(scope="module")
def server(run_dir):
    from lmforge.serve import start_server

    with start_server(run_dir, api_keys=[KEY], model_name="tiny", max_batch_size=4) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def greedy(ref, ids: list[int], max_tokens: int, stops: set[int]) -> tuple[str, int, str]:
    """(text, tokens generated, finish_reason) that serving must reproduce, from eval.generate."""
    out = generate(ref.model, ids, max_tokens, temperature=0.0, eos_id=sorted(stops))[0]
    if out and out[-1] in stops:
        return ref.tokenizer.decode(out[:-1]), len(out), "stop"
    return ref.tokenizer.decode(out), len(out), "length"


PROMPTS = ["The quick brown fox", "def main():\n    ", "import os", "Lists are mutable sequences",
           "class A:", "x = [1, 2, 3]\nprint(", "Hello"]


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].owned_by == "lmforge"
    assert client.models.retrieve("tiny").id == "tiny"


def test_completion_greedy_equals_generate(client, ref):
    for prompt in PROMPTS[:3]:
        ids = ref.tokenizer.encode(prompt)
        want, n, reason = greedy(ref, ids, 20, {ref.tokenizer.eos_id})
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
        assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")
        assert [(c.index, c.text, c.finish_reason) for c in r.choices] == [(0, want, reason)]
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), n,
                                                                                            len(ids) + n)
        # the same through the stream: text deltas that add up, one finish, usage at the end
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        texts = [c.choices[0].text for c in chunks if c.choices]
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert "".join(texts) == want and reasons == [reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n


def test_token_id_prompts_and_prompt_lists(client, ref):
    ids = [ref.tokenizer.encode(p) for p in PROMPTS[:3]]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, n=2)
    assert len(r.choices) == 6
    for c in r.choices:
        want = greedy(ref, ids[c.index // 2], 6, {ref.tokenizer.eos_id})[0]
        assert c.text == want
    assert r.usage.prompt_tokens == sum(map(len, ids))


def test_chat_greedy_equals_generate_with_chatml(client, ref):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a list method."}]
    template = ChatTemplate.chatml()  # the run was not fine-tuned
    ids = chat_prompt_ids(template, ref.tokenizer, messages)
    want, n, reason = greedy(ref, ids, 16, stop_ids(template, ref.tokenizer))
    assert "<|im_end|>" not in want  # otherwise the reply would be cut at it (a stop string here)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert (c.message.role, c.message.content, c.finish_reason) == ("assistant", want, reason)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), n)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [reason]


def test_stop_strings_and_max_tokens(client, ref):
    prompt = PROMPTS[3]
    full, _, _ = greedy(ref, ref.tokenizer.encode(prompt), 30, {ref.tokenizer.eos_id})
    stop = full[8:11]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0,
                                  stop=[stop, "\x00"])
    assert r.choices[0].text == full[: full.find(stop)] and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[: full.find(stop)]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_seeded_sampling_is_reproducible_and_n_choices_differ(client):
    kw = dict(model="tiny", prompt="The", max_tokens=12, temperature=1.0, top_p=0.95, n=3)
    a = client.completions.create(seed=11, **kw)
    b = client.completions.create(seed=11, **kw)
    c = client.completions.create(seed=12, **kw)
    texts = lambda r: [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]  # noqa: E731
    assert texts(a) == texts(b) and len(texts(a)) == 3
    assert texts(a) != texts(c) and len(set(texts(a))) > 1


def test_concurrent_requests_equal_their_solo_output(client, ref, server):
    budgets = [24, 9, 30, 15, 20, 12, 27]
    solo = [greedy(ref, ref.tokenizer.encode(p), k, {ref.tokenizer.eos_id}) for p, k in zip(PROMPTS, budgets)]
    peak = server.engine.peak_batch
    server.engine.peak_batch = 0
    got: dict[int, tuple] = {}

    def call(i):
        if i % 2:
            chunks = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=budgets[i],
                                               temperature=0, stream=True)
            parts = [(c.choices[0].text, c.choices[0].finish_reason) for c in chunks]
            got[i] = ("".join(t for t, _ in parts), [r for _, r in parts if r])
        else:
            r = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=budgets[i],
                                          temperature=0)
            got[i] = (r.choices[0].text, [r.choices[0].finish_reason])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert server.engine.peak_batch > 1, "the requests were never batched together"
    server.engine.peak_batch = max(peak, server.engine.peak_batch)
    for i, (text, _, reason) in enumerate(solo):
        assert got[i] == (text, [reason]), i
