"""Scoring against `lmforge serve`: lm-evaluation-harness's `local-completions` model pointed at the
server gives the per-document log-likelihoods and greedy flags of `lmforge eval --tasks` (run_task with
lmforge's Scorer) on the same model within 1e-5, and the same generations, with token-id prompts
and with text prompts (tokenized_requests=False); through the official
`openai` client, logprobs of completions and chat (streamed equal to not streamed), `echo` with
`max_tokens: 0` equal to the scorer per token, and refusals naming the field."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from conftest import corpus_paragraphs
from lmforge.config.schema import ModelConfig
from lmforge.data.tokenizer import Tokenizer
from lmforge.models import build_model
from lmforge.models.hf import to_hf

lm_eval = pytest.importorskip("lm_eval")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")

MAX_LEN = 96
ATOL = 1e-5
TASKS = ["t_mc", "t_ll", "t_gen"]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "DISABLE_MULTIPROC": "1"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny model exported in Hugging Face's format (the server loads it; the harness reads its
    tokenizer, since lmforge's is no hub name) and three local tasks."""
    for k, v in OFFLINE.items():
        os.environ.setdefault(k, v)
    root = tmp_path_factory.mktemp("serve_lm_eval")
    texts = corpus_paragraphs()
    tok = Tokenizer.train(texts, vocab_size=400)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                      max_seq_len=MAX_LEN, tie_embeddings=False)
    torch.manual_seed(0)
    model = build_model(cfg, torch.device("cpu"))
    with torch.no_grad():  # sharper distributions than the small init, so choices differ clearly
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    hf_dir = root / "hf"
    to_hf(model, hf_dir)
    tok.save_hf(hf_dir, MAX_LEN)
    rng = random.Random(0)
    data, tasks = root / "data", root / "tasks"
    data.mkdir()
    tasks.mkdir()
    mc, gen, ll = [], [], []
    for i in range(10):
        words = texts[i].split()
        cut = len(words) // 2
        others = rng.sample([t for k, t in enumerate(texts) if k != i], 3)
        right = " ".join(words[cut : cut + 4])
        choices = [right] + [" ".join(o.split()[:4]) for o in others]
        rng.shuffle(choices)
        question = " ".join(words[:cut][-6:])
        # short enough that neither side cuts it (the harness keeps one position for a generated token)
        assert all(len(tok.encode(f"Text: {question}\nNext: {c}")) < MAX_LEN - 2 for c in choices)
        mc.append({"question": question, "choices": choices, "label": choices.index(right)})
        gen.append({"prompt": " ".join(words[:8]) + " ", "answer": words[8]})
        prompt = " ".join(words[:8])
        with torch.no_grad():  # every other answer is the model's greedy next token: flags both ways
            best = int(model(torch.tensor([tok.encode(prompt)]))[0, -1].argmax())
        ll.append({"prompt": prompt, "answer": tok.decode([best]) if i % 2 else " " + words[8]})
    for name, rows in (("mc", mc), ("gen", gen), ("ll", ll)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    head = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (tasks / "t_mc.yaml").write_text(
        "task: t_mc\n" + head.format(data / "mc.jsonl") + "output_type: multiple_choice\n"
        'doc_to_text: "Text: {{question}}\\nNext:"\ndoc_to_target: label\ndoc_to_choice: choices\n'
        "metric_list:\n  - metric: acc\n")
    (tasks / "t_gen.yaml").write_text(
        "task: t_gen\n" + head.format(data / "gen.jsonl") + "output_type: generate_until\n"
        "doc_to_text: prompt\ndoc_to_target: answer\n"
        'generation_kwargs:\n  until: [" ", "\\n"]\n  max_gen_toks: 6\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n")
    (tasks / "t_ll.yaml").write_text(
        "task: t_ll\n" + head.format(data / "ll.jsonl") + "output_type: loglikelihood\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{answer}}"\ntarget_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n")
    return dict(hf_dir=hf_dir, tasks=tasks)


@pytest.fixture(scope="module")
def ref(setup):
    from lmforge.eval.open_run import load_run

    return load_run(setup["hf_dir"])


@pytest.fixture(scope="module")
def server(setup):
    from lmforge.serve import start_server

    with start_server(setup["hf_dir"], api_keys=None, model_name="tiny", max_batch_size=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)


def test_local_completions_equals_lmforge_eval_tasks(setup, ref, server):
    """The harness sends each context + continuation as token ids (its HF tokenizer is the run's),
    with echo, max_tokens 1 and logprobs 1, and reads the prompt tokens' logprobs."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from lmforge.eval.scorer import Scorer
    from lmforge.eval.tasks import load_task, run_task

    args = (f"model=tiny,base_url={server.url}/completions,tokenizer_backend=huggingface,"
            f"tokenizer={setup['hf_dir']},tokenized_requests=True,max_length={MAX_LEN - 1},"
            "num_concurrent=1,max_retries=1,batch_size=8")
    tm = TaskManager(include_path=str(setup["tasks"]), include_defaults=False)
    theirs = simple_evaluate(model="local-completions", model_args=args, tasks=TASKS, task_manager=tm,
                             log_samples=True, bootstrap_iters=0)
    scorer = Scorer(ref.model, ref.tokenizer, batch_size=8)
    for name in TASKS:
        ours = run_task(load_task(setup["tasks"] / f"{name}.yaml"), scorer).samples
        docs = sorted(theirs["samples"][name], key=lambda s: s["doc_id"])
        assert len(docs) == len(ours) == 10
        for s, t in zip(ours, docs):
            if name == "t_gen":
                assert t["resps"][0][0] == s["response"]
                continue
            lls = [r[0][0] for r in t["resps"]]
            want = s["loglikelihoods"] if name == "t_mc" else [s["loglikelihood"]]
            # lmforge's scorer sums a document's ~50 token log-probs in float32, the harness adds the
            # server's values in float64: the sums differ by a few float32 ulps of ~-100 (2^-23 relative
            # each), the tokens' values by less than 1e-5 (test_echo_scores_the_prompt_like_the_scorer)
            assert lls == pytest.approx(want, abs=ATOL, rel=4 * 2**-23)
            if name == "t_ll":
                assert bool(t["resps"][0][0][1]) == bool(s["greedy"])
    flags = [s["resps"][0][0][1] for s in theirs["samples"]["t_ll"]]
    assert any(flags) and not all(flags)  # greedy read from top_logprobs, both ways
    # text prompts (tokenized_requests=False): the server tokenizes; the harness still needs the
    # tokenizer to count the context's tokens, and both count the same
    texts = simple_evaluate(model="local-completions", model_args=args.replace("tokenized_requests=True",
                            "tokenized_requests=False"), tasks=["t_ll"], task_manager=tm, log_samples=True,
                            bootstrap_iters=0)
    got = [s["resps"][0][0] for s in sorted(texts["samples"]["t_ll"], key=lambda s: s["doc_id"])]
    want = [s["resps"][0][0] for s in sorted(theirs["samples"]["t_ll"], key=lambda s: s["doc_id"])]
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=ATOL)
    assert [g[1] for g in got] == [w[1] for w in want]


def test_echo_scores_the_prompt_like_the_scorer(client, ref):
    from lmforge.eval.scorer import Scorer

    prompt = "The model reads every token of this prompt and scores it"
    ids = ref.tokenizer.encode(prompt)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text == prompt and c.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert "".join(lp.tokens) == prompt and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [len(ref.tokenizer.decode(ids[:i])) for i in range(len(ids))]
    scorer = Scorer(ref.model, ref.tokenizer)
    want = scorer.loglikelihood_tokens([(ids[:i], [ids[i]]) for i in range(1, len(ids))])
    assert lp.token_logprobs[1:] == pytest.approx([w[0] for w in want], abs=ATOL)
    assert all(2 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2,
                                            stream=True))
    streamed = [c for ch in chunks for c in ch.choices]
    assert "".join(c.text for c in streamed) == prompt and streamed[-1].finish_reason == "length"
    assert [x for c in streamed for x in c.logprobs.token_logprobs] == lp.token_logprobs
    # echo with generation: the prompt, then the reply; its offsets go on past the prompt
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=5, echo=True, logprobs=0,
                                  temperature=0)
    c = r.choices[0]
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0).choices[0]
    assert c.text == prompt + plain.text and len(c.logprobs.tokens) == len(ids) + 5
    assert c.logprobs.text_offset[len(ids)] == len(prompt)


def joined(entries) -> str:
    """The text of chat logprobs entries (a random model splits characters: their bytes, not tokens)."""
    return bytes(b for e in entries for b in e.bytes).decode(errors="replace")


def test_streamed_logprobs_equal_the_whole(client):
    for chat in (False, True):
        kw = dict(model="tiny", max_tokens=12, temperature=0, stop=["e"])
        if chat:
            kw.update(messages=[{"role": "user", "content": "Tell me"}], logprobs=True, top_logprobs=3)
            whole = client.chat.completions.create(**kw).choices[0]
            stream = list(client.chat.completions.create(stream=True, **kw))
            got = [e for ch in stream for c in ch.choices if c.logprobs for e in c.logprobs.content]
            want = whole.logprobs.content
            assert [e.model_dump() for e in got] == [e.model_dump() for e in want]
            assert all(len(e.top_logprobs) == 3 and bytes(e.bytes).decode(errors="replace") for e in want)
            assert want and joined(want).startswith(whole.message.content)
            for ch in stream:  # each chunk carries the tokens of its text
                for c in ch.choices:
                    if c.delta.content:
                        assert joined(c.logprobs.content).startswith(c.delta.content)
        else:
            kw.update(prompt="The quick brown fox", logprobs=2)
            whole = client.completions.create(**kw).choices[0]
            stream = list(client.completions.create(stream=True, **kw))
            tokens = [t for ch in stream for c in ch.choices if c.logprobs for t in c.logprobs.tokens]
            offsets = [t for ch in stream for c in ch.choices if c.logprobs for t in c.logprobs.text_offset]
            assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
            assert "".join(c.text for ch in stream for c in ch.choices) == whole.text


def test_without_logprobs_nothing_changes(client):
    r = client.completions.create(model="tiny", prompt="The quick", max_tokens=6, temperature=0)
    with_lp = client.completions.create(model="tiny", prompt="The quick", max_tokens=6, temperature=0,
                                        logprobs=1)
    assert r.choices[0].logprobs is None and r.choices[0].text == with_lp.choices[0].text


@pytest.mark.parametrize("route, body, param", [
    ("completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "top_logprobs": 1}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                          "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
])
def test_refusals_name_the_field(server, route, body, param):
    import httpx

    r = httpx.post(f"{server.url}/{route}", json={"model": "tiny", **body}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and f"'{param}'" in err["message"]
