"""Log-probabilities in the serving engine and their OpenAI shapes: generated tokens' logprobs equal the
raw model's log_softmax over the whole sequence (greedy and sampled, alone and in a batch), held-back
tokens travel with the text that releases them, stop tokens are reported (one entry per generated
token), prompt logprobs equal lmforge's scorer per token (max_tokens 0 scores the prompt alone), a
request that does not ask costs no log_softmax and gets exactly what it got before; the request fields
are honoured or refused."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from conftest import corpus_paragraphs
from lmforge.config import ModelConfig
from lmforge.data.tokenizer import Tokenizer
from lmforge.eval.scorer import Scorer
from lmforge.models import Transformer
from lmforge.serve import engine as engine_mod
from lmforge.serve.engine import Engine, SamplingParams
from lmforge.serve.logprobs import Shaper, TokenLogprob, TokenText, merge
from lmforge.serve.protocol import ChatCompletionRequest, CompletionRequest

V = 61


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                   max_seq_len=32, tie_embeddings=False, init_std=0.1)).eval()


def text(ids) -> str:
    return "".join(chr(0x100 + t) for t in ids)


def run(engine: Engine, prompts, params) -> dict[int, list]:
    events: dict[int, list] = {}
    engine.submit(prompts, params, lambda ev: events.setdefault(ev.index, []).append(ev))
    while engine.step():
        pass
    for evs in events.values():
        assert evs[-1].finish_reason is not None and all(e.error is None for e in evs)
    return events


def reference(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of one forward over prompt + generated: row j predicts generated[j]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated]))[0].float()
    return logits.log_softmax(-1)[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_generated_logprobs_are_the_raw_models_in_a_batch(temperature):
    model = tiny()
    engine = Engine(model, text, max_batch_size=4)
    prompts = [[3, 4, 5], [7, 1], [9, 9, 9, 2, 8]]
    params = SamplingParams(max_tokens=8, temperature=temperature, top_k=5, seed=11, logprobs=3)
    events = run(engine, prompts, params)
    for i, p in enumerate(prompts):
        recs = [r for e in events[i] for r in e.logprobs]
        gen = [r.token for r in recs]
        assert len(gen) == 8 and text(gen) == "".join(e.text for e in events[i])
        want = reference(model, p, gen)
        got = torch.tensor([r.logprob for r in recs])
        # before temperature and top-k: the raw distribution, whatever the sampler kept
        assert torch.allclose(got, want.gather(1, torch.tensor(gen)[:, None])[:, 0], atol=1e-5)
        for r, row in zip(recs, want):
            top_v, top_i = row.topk(3)
            assert [t for t, _ in r.top] == top_i.tolist()
            assert torch.allclose(torch.tensor([v for _, v in r.top]), top_v, atol=1e-5)
            if temperature == 0:
                assert r.top[0][0] == r.token
        assert events[i][0].prompt_logprobs is None


def test_asking_costs_nothing_for_the_others_and_changes_no_output(monkeypatch):
    model = tiny()
    plain = SamplingParams(max_tokens=6, temperature=0.9, seed=3)
    alone = run(Engine(model, text), [[1, 2, 3]], plain)
    rows_normalised = []
    real = engine_mod.chosen_logprobs

    def counting(logits, tokens, ks):
        rows_normalised.append(logits.shape[0])
        return real(logits, tokens, ks)

    monkeypatch.setattr(engine_mod, "chosen_logprobs", counting)
    engine = Engine(model, text, max_batch_size=4)
    seen: dict[int, list] = {}
    engine.submit([[1, 2, 3]], plain, lambda ev: seen.setdefault(ev.index, []).append(ev))
    assert run(engine, [[5, 6]], SamplingParams(max_tokens=6, temperature=0, logprobs=0))
    assert rows_normalised and max(rows_normalised) == 1  # only the row that asked
    assert [(e.text, e.tokens, e.finish_reason) for e in seen[0]] == \
        [(e.text, e.tokens, e.finish_reason) for e in alone[0]]
    assert all(e.logprobs is None and e.prompt_logprobs is None for e in seen[0])
    rows_normalised.clear()
    run(Engine(model, text), [[1, 2, 3]], plain)
    assert rows_normalised == []


def test_held_back_tokens_go_with_the_text_that_releases_them_and_stop_tokens_are_reported():
    model = tiny()
    greedy = run(Engine(model, text), [[3, 4, 5]], SamplingParams(max_tokens=10, temperature=0))[0]
    ids = [ord(c) - 0x100 for c in "".join(e.text for e in greedy)]
    # a stop string made of generated tokens 4..5: tokens 3 and 4 are held back as its possible start
    stop = text(ids[4:6])
    events = run(Engine(model, text), [[3, 4, 5]], SamplingParams(max_tokens=10, temperature=0,
                                                                   stop=(stop,), logprobs=0))[0]
    assert "".join(e.text for e in events) == text(ids[:4])
    for e in events[:-1]:
        assert text(r.token for r in e.logprobs) == e.text
    assert [r.token for e in events for r in e.logprobs] == ids[:6]  # the stop string's tokens too
    assert [r.token for r in events[-1].logprobs] == ids[4:6]  # the held-back one with the last
    # a stop token: generated, counted and reported (as vLLM), though its text is not in the reply
    params = SamplingParams(max_tokens=10, temperature=0, stop_ids=frozenset({ids[2]}), logprobs=1)
    events = run(Engine(model, text), [[3, 4, 5]], params)[0]
    assert [r.token for e in events for r in e.logprobs] == ids[:3]
    assert "".join(e.text for e in events) == text(ids[:2])
    assert events[-1].tokens == 3 and events[-1].finish_reason == "stop"


def test_prompt_logprobs_equal_the_scorer_per_token():
    texts = corpus_paragraphs()[:40]
    tok = Tokenizer.train(texts, vocab_size=300)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=4,
                                    n_kv_heads=2, max_seq_len=64, tie_embeddings=False, init_std=0.1)).eval()
    prompt = tok.encode(texts[0])[:40]
    events = run(Engine(model, tok.decode), [prompt], SamplingParams(max_tokens=0, prompt_logprobs=2,
                                                                      logprobs=2))[0]
    assert len(events) == 1 and events[0].finish_reason == "length" and events[0].tokens == 0
    recs = events[0].prompt_logprobs
    assert [r.token for r in recs] == prompt and recs[0].logprob is None and recs[0].top == ()
    scorer = Scorer(model, tok, batch_size=8)
    want = scorer.loglikelihood_tokens([(prompt[:i], [prompt[i]]) for i in range(1, len(prompt))])
    for r, (ll, greedy) in zip(recs[1:], want):
        assert r.logprob == pytest.approx(ll, abs=1e-5)
        assert (r.top[0][0] == r.token) == greedy
    # with generation: the prompt's come once, on the first event of each choice
    events = run(Engine(model, tok.decode), [prompt], SamplingParams(max_tokens=4, temperature=0, n=2,
                                                                      prompt_logprobs=0, logprobs=0))
    for evs in events.values():
        assert [r.logprob for r in evs[0].prompt_logprobs] == [r.logprob for r in recs]
        assert all(e.prompt_logprobs is None for e in evs[1:])


def test_token_text_and_shapes():
    tok = Tokenizer.train(["héllo wörld " * 20, "naïve café"], vocab_size=270)
    tt = TokenText(tok)
    ids = tok.encode("hé")
    joined = b"".join(bytes(tt(i)[1]) for i in ids)
    assert joined == "hé".encode()
    lead = bytes([0xC3])  # a byte-level alphabet holds every single byte, here half of "é"
    half = next(i for i in range(tok.vocab_size) if tt(i)[1] == list(lead))
    assert tt(half)[0] == "bytes:\\xc3"
    recs = (TokenLogprob(ids[0], None), TokenLogprob(ids[-1], -0.5, ((ids[-1], -0.5), (half, -1.0))))
    gen = (TokenLogprob(half, -2.0, ((ids[0], -0.1),)),)
    s = Shaper(tt, chat=False, k=1, echo=["hé"])
    text0, piece0 = s.event(0, "", (), recs)
    text1, piece1 = s.event(0, "x", gen, None)
    whole = merge([piece0, piece1])
    assert text0 == "hé" and text1 == "x"
    assert whole["tokens"] == [tt(ids[0])[0], tt(ids[-1])[0], "bytes:\\xc3"]
    assert whole["token_logprobs"] == [None, -0.5, -2.0]
    assert whole["top_logprobs"][0] is None
    assert whole["top_logprobs"][1] == {tt(ids[-1])[0]: -0.5, "bytes:\\xc3": -1.0}
    # the chosen token is added when it is not among the k best (as vLLM)
    assert whole["top_logprobs"][2] == {tt(ids[0])[0]: -0.1, "bytes:\\xc3": -2.0}
    assert whole["text_offset"] == [0, len(tt(ids[0])[0]), 2]
    chat = Shaper(tt, chat=True, k=1).event(0, "x", gen, None)[1]
    assert chat == {"content": [{"token": "bytes:\\xc3", "logprob": -2.0, "bytes": [0xC3],
                                 "top_logprobs": [{"token": tt(ids[0])[0], "logprob": -0.1,
                                                   "bytes": tt(ids[0])[1]}]}]}
    assert Shaper(tt, chat=False, k=None, echo=["p"]).event(0, "x", None, None) == ("px", None)


def test_token_text_of_a_sentencepiece_style_vocabulary():
    """Llama-style vocabularies: "▁" stands for a space and <0xNN> tokens for single bytes."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "<0xC3>": 2, "<0xA9>": 3, "▁h": 4, "i": 5, "▁": 6}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tt = TokenText(Tokenizer(hf, eos_id=1))
    assert tt(4) == (" h", [32, 104]) and tt(5) == ("i", [105])
    assert tt(2) == ("bytes:\\xc3", [0xC3]) and tt(3)[1] == [0xA9]
    assert bytes(tt(2)[1] + tt(3)[1]).decode() == "é"


COMPLETION = {"model": "tiny", "prompt": "x"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("model, fields, k", [
    (CompletionRequest, {"logprobs": 0}, 0),
    (CompletionRequest, {"logprobs": 5}, 5),
    (CompletionRequest, {"logprobs": False}, None),
    (CompletionRequest, {"logprobs": 2, "echo": True, "max_tokens": 0}, 2),
    (CompletionRequest, {"echo": True, "max_tokens": 0}, None),
    (ChatCompletionRequest, {"logprobs": True}, 0),
    (ChatCompletionRequest, {"logprobs": True, "top_logprobs": 20}, 20),
    (ChatCompletionRequest, {"logprobs": False}, None),
    (ChatCompletionRequest, {"echo": False}, None),
])
def test_fields_that_work(model, fields, k):
    base = COMPLETION if model is CompletionRequest else CHAT
    assert model.model_validate({**base, **fields}).logprobs_k() == k


@pytest.mark.parametrize("model, fields, field, why", [
    (CompletionRequest, {"logprobs": 6}, "logprobs", "from 0 to 5"),
    (CompletionRequest, {"logprobs": True}, "logprobs", "from 0 to 5"),
    (CompletionRequest, {"logprobs": -1}, "logprobs", "from 0 to 5"),
    (CompletionRequest, {"logprobs": 1.0}, "logprobs", "from 0 to 5"),
    (CompletionRequest, {"top_logprobs": 2}, "top_logprobs", "chat completions field"),
    (CompletionRequest, {"echo": 1}, "echo", "true or false"),
    (CompletionRequest, {"max_tokens": 0}, "max_tokens", "only with 'echo'"),
    (ChatCompletionRequest, {"logprobs": 1}, "logprobs", "true or false"),
    (ChatCompletionRequest, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "from 0 to 20"),
    (ChatCompletionRequest, {"logprobs": True, "top_logprobs": True}, "top_logprobs", "from 0 to 20"),
    (ChatCompletionRequest, {"top_logprobs": 2}, "top_logprobs", "needs 'logprobs': true"),
    (ChatCompletionRequest, {"logprobs": False, "top_logprobs": 0}, "top_logprobs", "needs"),
    (ChatCompletionRequest, {"echo": True}, "echo", "/v1/completions field"),
    (ChatCompletionRequest, {"echo": 0}, "echo", "/v1/completions field"),
    (ChatCompletionRequest, {"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
])
def test_fields_refused(model, fields, field, why):
    base = COMPLETION if model is CompletionRequest else CHAT
    with pytest.raises(ValidationError, match=f"'{field}'|{field}") as e:
        model.model_validate({**base, **fields})
    assert why in str(e.value)
