"""Task evaluation (lmforge.eval.tasks / scorer) against lm-evaluation-harness's own HFLM on the
exported model, both in float64: the same local task YAMLs give the same prompts, per-document
log-likelihoods within 1e-9, the same greedy / acc / acc_norm / exact-match verdicts, the same rolling
log-likelihoods and generations; with --apply_chat_template (few-shot as one message and as turns)
the same ChatML prompts and scores.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from conftest import corpus_paragraphs
from lmforge.config.schema import ModelConfig
from lmforge.data.chat_template import ChatTemplate, stop_ids
from lmforge.data.tokenizer import Tokenizer
from lmforge.eval.scorer import Scorer
from lmforge.eval.tasks import load_task, run_task
from lmforge.models import build_model
from lmforge.models.hf import to_hf

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

# The harness bootstraps some standard errors in a fork()ed multiprocessing pool, which can deadlock in a
# process that already runs torch's threads: one process only (read by lm_eval.api.metrics).
os.environ["DISABLE_MULTIPROC"] = "1"
MAX_LEN = 96
ATOL = 1e-9  # float64 on both sides: the same function, computed in another order




@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    texts = corpus_paragraphs()
    tok = Tokenizer.train(texts, vocab_size=400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])  # ChatML's, for the chat-template prompts
    cfg = ModelConfig(
        vocab_size=tok.vocab_size,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_seq_len=MAX_LEN,
        tie_embeddings=False,
    )
    torch.manual_seed(0)
    model = build_model(cfg, torch.device("cpu"))
    with torch.no_grad():  # sharper distributions than the small init, so choices differ clearly
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    model.eval()
    model_fp64 = build_model(cfg, torch.device("cpu"))
    model_fp64.load_state_dict(model.state_dict())
    model_fp64.double().eval()
    hf_dir = root / "hf"
    to_hf(model, hf_dir)
    tok.save_hf(hf_dir, MAX_LEN, chat_template=ChatTemplate.chatml().source)

    rng = random.Random(0)
    data = root / "data"
    data.mkdir()
    mc, gen, roll = [], [], []
    for i in range(16):
        words = texts[i].split()
        cut = len(words) // 2
        others = rng.sample([t for k, t in enumerate(texts) if k != i], 3)
        choices = [" ".join(words[cut : cut + 4])] + [" ".join(o.split()[:4]) for o in others]
        rng.shuffle(choices)
        mc.append(
            {
                "question": " ".join(words[:cut]),
                "choices": choices,
                "label": choices.index(" ".join(words[cut : cut + 4])),
            }
        )
        gen.append({"prompt": " ".join(words[:8]) + " ", "answer": words[8]})
        roll.append({"text": texts[i] + " " + texts[i + 1]})  # some longer than the context
    mc_train = [{**r, "question": "Earlier: " + r["question"]} for r in mc[8:]]
    for name, rows in (("mc", mc), ("mc_train", mc_train), ("gen", gen), ("roll", roll)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "t_mc.yaml").write_text(
        "task: t_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data / 'mc.jsonl'}\n"
        f"    train: {data / 'mc_train.jsonl'}\n"
        "test_split: test\nfewshot_split: train\noutput_type: multiple_choice\n"
        'doc_to_text: "Text: {{question}}\\nNext:"\ndoc_to_target: label\ndoc_to_choice: choices\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (tasks / "t_mc_fewshot.yaml").write_text(
        "include: t_mc.yaml\ntask: t_mc_fewshot\nnum_fewshot: 2\nfewshot_config:\n  sampler: first_n\n"
        'description: "Continue the text.\\n\\n"\n'
    )
    (tasks / "t_gen.yaml").write_text(
        "task: t_gen\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data / 'gen.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\n"
        "doc_to_text: prompt\ndoc_to_target: answer\n"
        'generation_kwargs:\n  until: [" ", "\\n"]\n  max_gen_toks: 6\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    ignore_case: true\n"
    )
    (tasks / "t_ll.yaml").write_text(
        "task: t_ll\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data / 'gen.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_target: answer\n'
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n"
    )
    (tasks / "t_roll.yaml").write_text(
        "task: t_roll\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data / 'roll.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: text\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    return dict(model=model_fp64, tok=tok, hf_dir=hf_dir, tasks=tasks)


@pytest.fixture(scope="module")
def harness(setup):
    """lm-evaluation-harness's results for every task, on the exported model (no network)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(
        pretrained=str(setup["hf_dir"]), batch_size=4, max_length=MAX_LEN, device="cpu", dtype="float64"
    )
    tm = TaskManager(include_path=str(setup["tasks"]), include_defaults=False)
    names = ["t_mc", "t_mc_fewshot", "t_gen", "t_ll", "t_roll"]
    out = simple_evaluate(model=lm, tasks=names, task_manager=tm, log_samples=True, bootstrap_iters=10)
    return out


def ours(setup, name: str):
    scorer = Scorer(setup["model"], setup["tok"], batch_size=5)
    return run_task(load_task(setup["tasks"] / f"{name}.yaml"), scorer)


def by_doc(samples: list[dict]) -> list[dict]:
    return sorted(samples, key=lambda s: s["doc_id"])


def test_multiple_choice_per_document(setup, harness):
    for name in ("t_mc", "t_mc_fewshot"):
        res = ours(setup, name)
        theirs = by_doc(harness["samples"][name])
        assert len(theirs) == len(res.samples) == 16
        for s, t in zip(res.samples, theirs):
            assert [a[1] for a in t["arguments"]] == [" " + c for c in s["choices"]]
            lls = [r[0][0] for r in t["resps"]]
            assert torch.allclose(
                torch.tensor(s["loglikelihoods"], dtype=torch.float64),
                torch.tensor(lls, dtype=torch.float64),
                atol=ATOL,
                rtol=0,
            )
            assert float(s["pred"] == s["gold"]) == t["acc"]
            assert float(s["pred_norm"] == s["gold"]) == t["acc_norm"]
        agg = harness["results"][name]
        assert res.metrics["acc"] == pytest.approx(agg["acc,none"], abs=1e-12)
        assert res.metrics["acc_norm"] == pytest.approx(agg["acc_norm,none"], abs=1e-12)
        assert res.stderr["acc"] == pytest.approx(agg["acc_stderr,none"], abs=1e-9)


def test_prompts_equal_the_harness(setup, harness):
    for name in ("t_mc", "t_mc_fewshot", "t_gen"):
        res = ours(setup, name)
        theirs = by_doc(harness["samples"][name])
        assert len(theirs) == len(res.samples)
        for s, t in zip(res.samples, theirs):
            assert s["context"] == t["arguments"][0][0]


def test_generation_and_exact_match(setup, harness):
    res = ours(setup, "t_gen")
    theirs = by_doc(harness["samples"]["t_gen"])
    for s, t in zip(res.samples, theirs):
        assert s["response"] == t["resps"][0][0]
    assert [m for m in res.metrics] == ["exact_match"]
    assert res.metrics["exact_match"] == pytest.approx(
        harness["results"]["t_gen"]["exact_match,none"], abs=1e-12
    )


def test_loglikelihood_and_rolling(setup, harness):
    res = ours(setup, "t_ll")
    for s, t in zip(res.samples, by_doc(harness["samples"]["t_ll"])):
        ll, greedy = t["resps"][0][0]
        assert s["loglikelihood"] == pytest.approx(ll, abs=ATOL)
        assert s["greedy"] == bool(greedy)
    agg = harness["results"]["t_ll"]
    assert res.metrics["perplexity"] == pytest.approx(agg["perplexity,none"], rel=1e-12)
    assert res.metrics["acc"] == pytest.approx(agg["acc,none"], abs=1e-12)

    res = ours(setup, "t_roll")
    for s, t in zip(res.samples, by_doc(harness["samples"]["t_roll"])):
        assert s["loglikelihood"] == pytest.approx(t["resps"][0][0], abs=ATOL)
    agg = harness["results"]["t_roll"]
    for m in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert res.metrics[m] == pytest.approx(agg[f"{m},none"], rel=1e-12)


@pytest.fixture(scope="module")
def harness_chat(setup):
    """The harness with --apply_chat_template, few-shot examples as one user message and as turns."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(
        pretrained=str(setup["hf_dir"]), batch_size=4, max_length=MAX_LEN, device="cpu", dtype="float64"
    )
    tm = TaskManager(include_path=str(setup["tasks"]), include_defaults=False)
    return {
        multiturn: simple_evaluate(
            model=lm,
            tasks=["t_mc", "t_mc_fewshot"],
            task_manager=tm,
            log_samples=True,
            bootstrap_iters=10,
            apply_chat_template=True,
            fewshot_as_multiturn=multiturn,
        )
        for multiturn in (False, True)
    }


@pytest.mark.parametrize("multiturn", [False, True])
def test_chat_template_prompts_equal_the_harness(setup, harness_chat, multiturn):
    template = ChatTemplate.chatml()
    scorer = Scorer(
        setup["model"], setup["tok"], batch_size=5, chat=True, stops=stop_ids(template, setup["tok"])
    )
    render = lambda messages: template.render(messages, add_generation_prompt=True)  # noqa: E731
    for name in ("t_mc", "t_mc_fewshot"):
        res = run_task(load_task(setup["tasks"] / f"{name}.yaml"), scorer, chat=render, multiturn=multiturn)
        theirs = by_doc(harness_chat[multiturn]["samples"][name])
        assert len(theirs) == len(res.samples) == 16
        for s, t in zip(res.samples, theirs):
            assert s["context"] == t["arguments"][0][0]
            assert "<|im_start|>assistant" in s["context"]
            assert [a[1] for a in t["arguments"]] == s["choices"]  # no delimiter after a chat prompt
            lls = [r[0][0] for r in t["resps"]]
            assert torch.allclose(
                torch.tensor(s["loglikelihoods"], dtype=torch.float64),
                torch.tensor(lls, dtype=torch.float64),
                atol=ATOL,
                rtol=0,
            )
        agg = harness_chat[multiturn]["results"][name]
        assert res.metrics["acc"] == pytest.approx(agg["acc,none"], abs=1e-12)
        assert res.metrics["acc_norm"] == pytest.approx(agg["acc_norm,none"], abs=1e-12)
