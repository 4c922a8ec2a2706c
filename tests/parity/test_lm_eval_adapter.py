"""lm-evaluation-harness scoring an lmforge run through lmforge's model adapter (`--model lmforge`)
against the harness's own HFLM on the exported model: the same local tasks, per-document
log-likelihoods at float32 1e-5, the same greedy flags, generations and aggregated metrics; the
`python -m lmforge.eval.lm_eval_model` command line; clear errors.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import corpus_paragraphs
from lmforge.config.schema import ModelConfig
from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import LmforgeError
from lmforge.models import build_model
from lmforge.models.hf import to_hf

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

MAX_LEN = 96
ATOL = 1e-5
TASKS = ["t_mc", "t_ll", "t_gen", "t_roll"]
# DISABLE_MULTIPROC: the harness bootstraps some standard errors in a fork()ed pool, which can deadlock in
# a process that already runs torch's threads.
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "DISABLE_MULTIPROC": "1"}




@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    for k, v in OFFLINE.items():
        os.environ.setdefault(k, v)
    root = tmp_path_factory.mktemp("lm_eval_adapter")
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
    data = root / "data"
    data.mkdir()
    mc, gen, ll, roll = [], [], [], []
    for i in range(12):
        words = texts[i].split()
        cut = len(words) // 2
        others = rng.sample([t for k, t in enumerate(texts) if k != i], 3)
        right = " ".join(words[cut : cut + 4])
        choices = [right] + [" ".join(o.split()[:4]) for o in others]
        rng.shuffle(choices)
        mc.append({"question": " ".join(words[:cut]), "choices": choices, "label": choices.index(right)})
        gen.append({"prompt": " ".join(words[:8]) + " ", "answer": words[8]})
        roll.append({"text": texts[i] + " " + texts[i + 1]})  # some longer than the context
        prompt = " ".join(words[:8])
        with torch.no_grad():  # every other answer is the model's greedy next token: flags both ways
            best = int(model(torch.tensor([tok.encode(prompt)]))[0, -1].argmax())
        ll.append({"prompt": prompt, "answer": tok.decode([best]) if i % 2 else " " + words[8]})
    for name, rows in (("mc", mc), ("gen", gen), ("ll", ll), ("roll", roll)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = root / "tasks"
    tasks.mkdir()
    head = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (tasks / "t_mc.yaml").write_text(
        "task: t_mc\n" + head.format(data / "mc.jsonl") + "output_type: multiple_choice\n"
        'doc_to_text: "Text: {{question}}\\nNext:"\ndoc_to_target: label\ndoc_to_choice: choices\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (tasks / "t_gen.yaml").write_text(
        "task: t_gen\n" + head.format(data / "gen.jsonl") + "output_type: generate_until\n"
        "doc_to_text: prompt\ndoc_to_target: answer\n"
        'generation_kwargs:\n  until: [" ", "\\n"]\n  max_gen_toks: 6\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    ignore_case: true\n"
    )
    (tasks / "t_ll.yaml").write_text(
        "task: t_ll\n" + head.format(data / "ll.jsonl") + "output_type: loglikelihood\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{answer}}"\ntarget_delimiter: ""\n'
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n"
    )
    (tasks / "t_roll.yaml").write_text(
        "task: t_roll\n" + head.format(data / "roll.jsonl") + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: text\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    return dict(hf_dir=hf_dir, tasks=tasks, root=root)


def evaluate(setup, model, model_args=None, **kw):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(setup["tasks"]), include_defaults=False)
    return simple_evaluate(model=model, model_args=model_args, tasks=TASKS, task_manager=tm, log_samples=True,
                           bootstrap_iters=10, **kw)


@pytest.fixture(scope="module")
def both(setup):
    """The harness's results with its HFLM and with lmforge's model, on the same exported model."""
    from lm_eval.models.huggingface import HFLM

    import lmforge.eval.lm_eval_model  # noqa: F401  (registers "lmforge")

    hf = HFLM(pretrained=str(setup["hf_dir"]), batch_size=4, max_length=MAX_LEN, device="cpu",
              dtype="float32")
    theirs = evaluate(setup, hf)
    ours = evaluate(setup, "lmforge", f"path={setup['hf_dir']},batch_size=4,device=cpu")
    return ours, theirs


def by_doc(samples: list[dict]) -> list[dict]:
    return sorted(samples, key=lambda s: s["doc_id"])


def test_per_document_responses_equal_hflm(both):
    ours, theirs = both
    for name in TASKS:
        mine, ref = by_doc(ours["samples"][name]), by_doc(theirs["samples"][name])
        assert len(mine) == len(ref) == 12
        for a, b in zip(mine, ref):
            assert a["arguments"] == b["arguments"]  # the same prompts
            for ra, rb in zip(a["resps"], b["resps"], strict=True):
                ra, rb = ra[0], rb[0]
                if name == "t_gen":
                    assert ra == rb
                elif name in ("t_mc", "t_ll"):
                    assert ra[0] == pytest.approx(rb[0], abs=ATOL)
                    assert bool(ra[1]) == bool(rb[1])
                else:
                    assert ra == pytest.approx(rb, abs=1e-4)  # a sum over windows of ~100 tokens
    greedy = [s["resps"][0][0][1] for s in ours["samples"]["t_ll"]]
    assert any(greedy) and not all(greedy)  # the flags are tested both ways


def test_aggregated_metrics_equal_hflm(both):
    ours, theirs = both
    for name in TASKS:
        mine, ref = ours["results"][name], theirs["results"][name]
        assert set(mine) == set(ref)
        for key, value in ref.items():
            if key.split(",")[0] in ("acc", "acc_norm", "exact_match", "acc_stderr", "acc_norm_stderr",
                                     "exact_match_stderr"):
                assert mine[key] == value, key
            elif isinstance(value, float):
                assert mine[key] == pytest.approx(value, rel=1e-5), key
    info = ours["config"]
    assert info["model"] == "lmforge" and info["lmforge_weights"] == "model"


def test_command_line(setup, both, monkeypatch, capsys):
    """`python -m lmforge.eval.lm_eval_model` is lm_eval's CLI with the model registered: the module run
    as `__main__`, here in this process (runpy, as `-m` does; a process of its own costs ~10 s of starting
    torch and the harness: the slow tier's test_command_line_as_documented runs the real command). The
    harness's built-in task index is skipped here only to keep the test quick."""
    import runpy
    import warnings

    from lm_eval.tasks import TaskManager

    monkeypatch.setattr(TaskManager, "__init__", functools.partialmethod(TaskManager.__init__,
                                                                         include_defaults=False))
    out = setup["root"] / "cli_out"
    args = ["--model", "lmforge", "--model_args", f"path={setup['hf_dir']},batch_size=4", "--tasks", "t_gen",
            "--include_path", str(setup["tasks"]), "--limit", "4", "--device", "cpu", "--log_samples",
            "--output_path", str(out)]
    monkeypatch.setattr(sys, "argv", ["lm_eval_model.py", *args])
    capsys.readouterr()
    # runpy warns that the module is imported already: in this process it is (the fixtures registered it);
    # the `-m` block re-runs it as __main__ and calls the imported module's main, as in a process of its own
    with warnings.catch_warnings(), pytest.raises(SystemExit) as exited:
        warnings.filterwarnings("ignore", "'lmforge.eval.lm_eval_model' found in sys.modules", RuntimeWarning)
        runpy.run_module("lmforge.eval.lm_eval_model", run_name="__main__", alter_sys=True)
    assert exited.value.code == 0, capsys.readouterr().err[-3000:]
    assert "exact_match" in capsys.readouterr().out
    (samples,) = glob.glob(str(out / "**" / "samples_t_gen_*.jsonl"), recursive=True)
    cli = [json.loads(line) for line in Path(samples).read_text().splitlines()]
    ref = by_doc(both[0]["samples"]["t_gen"])[:4]
    assert [s["resps"][0][0] for s in by_doc(cli)] == [s["resps"][0][0] for s in ref]


def test_command_line_errors(setup, monkeypatch, capsys):
    """A user error is one line on stderr and exit status 2, as for `lmforge` itself."""
    from lm_eval.tasks import TaskManager

    from lmforge.eval.lm_eval_model import main

    monkeypatch.setattr(TaskManager, "__init__", functools.partialmethod(TaskManager.__init__,
                                                                         include_defaults=False))
    bad = setup["root"] / "no_such_run"
    argv = ["--model", "lmforge", "--model_args", f"path={bad}", "--tasks", "t_gen", "--include_path",
            str(setup["tasks"])]
    assert main(argv) == 2
    assert f"lmforge lm_eval: error: no such run or checkpoint: {bad}" in capsys.readouterr().err


@pytest.mark.slow
def test_command_line_as_documented(setup):
    """The real `python -m lmforge.eval.lm_eval_model ...` (it indexes the harness's ~15k built-in tasks)."""
    cmd = [sys.executable, "-m", "lmforge.eval.lm_eval_model", "--model", "lmforge", "--model_args",
           f"path={setup['hf_dir']}", "--batch_size", "4", "--tasks", str(setup["tasks"] / "t_mc.yaml"),
           "--limit", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **OFFLINE})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "acc_norm" in proc.stdout


def test_clear_errors(setup):
    from lm_eval.api.registry import get_model

    from lmforge.eval.lm_eval_model import LmforgeLM

    assert get_model("lmforge") is LmforgeLM
    assert get_model("hf").__name__ == "HFLM"  # the harness's own models stay registered
    with pytest.raises(LmforgeError, match="no such run or checkpoint"):
        evaluate(setup, "lmforge", f"path={setup['root'] / 'missing'}")
    with pytest.raises(LmforgeError, match="needs model_args path="):
        LmforgeLM.create_from_arg_string("batch_size=4")
    with pytest.raises(LmforgeError, match="unknown lmforge model_args: pretrained"):
        LmforgeLM.create_from_arg_string(f"path={setup['hf_dir']},pretrained=x")
    with pytest.raises(LmforgeError, match="has no batch_size=auto"):
        LmforgeLM.create_from_arg_string(f"path={setup['hf_dir']},batch_size=auto")


def test_sampling_chat_and_settings(setup):
    from lm_eval.api.instance import Instance

    from lmforge.data.chat_template import ChatTemplate
    from lmforge.eval.lm_eval_model import LmforgeLM

    # the harness's --device default (cuda:0) without CUDA is the CPU, as for HFLM; model_args win
    lm = LmforgeLM.create_from_arg_string(f"path={setup['hf_dir']},batch_size=3,seed=7",
                                          {"device": "cpu" if torch.cuda.is_available() else "cuda:0",
                                           "batch_size": 1})
    assert lm.batch_size == 3 and lm.device == torch.device("cpu") and lm.max_length == MAX_LEN

    def reqs(gen_kwargs, n=4):
        return [Instance("generate_until", {}, ("The module imports", dict(gen_kwargs)), i) for i in range(n)]

    sampled = {"until": ["\n"], "max_gen_toks": 8, "do_sample": True, "temperature": 1.0, "top_k": 50}
    first = lm.generate_until(reqs(sampled), disable_tqdm=True)
    again = LmforgeLM(path=str(setup["hf_dir"]), batch_size=3, seed=7, device="cpu")
    assert again.generate_until(reqs(sampled), disable_tqdm=True) == first  # seeded: a run repeats
    assert len(set(first)) > 1  # and draws differ between documents
    greedy = {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}
    greedy = lm.generate_until(reqs(greedy), disable_tqdm=True)
    assert len(set(greedy)) == 1
    with pytest.raises(LmforgeError, match="does not support generation settings \\['typical_p'\\]"):
        lm.generate_until(reqs({"until": [], "do_sample": False, "typical_p": 0.5}, 1), disable_tqdm=True)

    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    template = ChatTemplate.chatml()
    assert lm.apply_chat_template(chat[:1]) == template.render(chat[:1], add_generation_prompt=True)
    prefill = lm.apply_chat_template(chat, add_generation_prompt=False)
    assert prefill.endswith("Hello") and template.render(chat).startswith(prefill)
    assert lm.chat_template(True) == template.source and lm.chat_template(False) is None


def test_needs_lm_eval(monkeypatch):
    import importlib

    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.delitem(sys.modules, "lmforge.eval.lm_eval_model", raising=False)
    with pytest.raises(LmforgeError, match="pip install 'lm_eval"):
        importlib.import_module("lmforge.eval.lm_eval_model")
