"""Sliding-window perplexity (lmforge.eval.perplexity) against the loop of the Hugging Face guide
"Perplexity of fixed-length models" run with transformers on the exported model, over the same token
stream: the same windows, the same summed NLL (float32 1e-5; float64 to 1e-10) and target count.

The guide accumulates `loss * (valid labels - 1)`. transformers shifts the labels, so a window whose
targets have context before them (stride < max_length) averages over all its `valid labels`: the
guide's count is one short there. The exact per-token sum is `loss * labels the model averaged`, and
that is what lmforge reports; the tests check both facts.
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import corpus_paragraphs
from lmforge.config.schema import ModelConfig
from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import DataError
from lmforge.eval.metrics import expected_calibration_error
from lmforge.eval.perplexity import (
    evaluate_perplexity,
    read_texts,
    sliding_windows,
    strided_eval,
    token_stream,
)
from lmforge.models import build_model
from lmforge.models.hf import to_hf

transformers = pytest.importorskip("transformers")

MAX = 64
# (max_length, stride): disjoint windows, overlapping ones, a stride that leaves a short last window,
# a context shorter than the model's, and stride 1.
PAIRS = [(MAX, MAX), (MAX, MAX // 2), (MAX, 17), (40, 40), (40, 13), (16, 1)]




@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    texts = corpus_paragraphs()
    tok = Tokenizer.train(texts, vocab_size=400)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                      max_seq_len=MAX, tie_embeddings=False)
    torch.manual_seed(0)
    model = build_model(cfg, torch.device("cpu"))
    # A few steps on other paragraphs: sharp, partly right predictions (a random model's top-1 is ~0).
    train = torch.tensor(token_stream(tok, texts[:100]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(40):
        starts = torch.randint(0, len(train) - MAX - 1, (4,))
        x = torch.stack([train[s : s + MAX + 1] for s in starts])
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    hf_dir = tmp_path_factory.mktemp("strided") / "hf"
    to_hf(model, hf_dir)
    tok.save_hf(hf_dir, MAX)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    docs = texts[100:110]  # held out from the training above
    n = next(k for k in range(1, len(docs)) if len(token_stream(tok, docs[:k])) > 4 * MAX)
    ids = token_stream(tok, docs[:n])  # several contexts long, not much more (the guide's loop is slow)
    return tok, model, hf, hf_dir, docs, ids


def guide_loop(hf, ids: list[int], max_length: int, stride: int) -> dict:
    """The guide's loop, with its count (`literal_*`) and with the count of labels the model averaged."""
    encodings = torch.tensor([ids])
    seq_len = encodings.size(1)
    nll_sum, n_tokens, literal_sum, literal_tokens, windows = 0.0, 0, 0.0, 0, 0
    prev_end_loc = 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + max_length, seq_len)
        trg_len = end_loc - prev_end_loc  # may be different from stride on the last loop
        input_ids = encodings[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            if hf.dtype == torch.float32:
                neg_log_likelihood = hf(input_ids, labels=target_ids).loss
            else:  # transformers' loss upcasts to float32 only: the same cross entropy, in float64
                logits = hf(input_ids).logits[0, :-1]
                neg_log_likelihood = F.cross_entropy(logits, target_ids[0, 1:], ignore_index=-100)
        num_valid_tokens = (target_ids != -100).sum().item()
        batch_size = target_ids.size(0)
        num_loss_tokens = num_valid_tokens - batch_size  # the guide: "subtract batch_size due to shift"
        literal_sum += float(neg_log_likelihood) * num_loss_tokens
        literal_tokens += num_loss_tokens
        averaged = int((target_ids[:, 1:] != -100).sum())  # what the loss was the mean of
        nll_sum += float(neg_log_likelihood) * averaged
        n_tokens += averaged
        windows += 1
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return {"nll_sum": nll_sum, "tokens": n_tokens, "literal_sum": literal_sum,
            "literal_tokens": literal_tokens, "windows": windows}


def test_windows_are_the_guides():
    n = 203
    for max_length, stride in PAIRS:
        windows = sliding_windows(n, max_length, stride)
        prev = 0
        for w, begin in zip(windows, range(0, n, stride), strict=False):
            assert (w.begin, w.end) == (begin, min(begin + max_length, n))
            assert w.targets == min(w.end - prev, w.end - w.begin - 1)
            prev = w.end
        assert windows[-1].end == n and all(w.end < n for w in windows[:-1])
        scored = sum(w.targets for w in windows)
        # every token after the first once; disjoint windows cannot score their first tokens
        assert scored == (n - len(windows) if stride == max_length else n - 1)


@pytest.mark.parametrize(("max_length", "stride"), PAIRS)
def test_nll_matches_guide_float32(setup, max_length, stride):
    _, model, hf, _, _, ids = setup
    ids = ids[: 6 * max_length] if stride < 4 else ids  # one forward per token: keep it short
    ours = strided_eval(model, ids, max_length=max_length, stride=stride, batch_size=3)
    ref = guide_loop(hf, ids, max_length, stride)
    assert ours["tokens"] == ref["tokens"]
    assert ours["windows"] == ref["windows"]
    assert ours["nll_sum"] == pytest.approx(ref["nll_sum"], rel=1e-5)
    assert ours["loss"] == pytest.approx(ref["nll_sum"] / ref["tokens"], rel=1e-5)
    assert ours["ppl"] == pytest.approx(math.exp(ref["nll_sum"] / ref["tokens"]), rel=1e-5)
    if stride == max_length:  # no window has context: the guide's own count is exact
        assert ours["tokens"] == ref["literal_tokens"]
        assert ours["nll_sum"] == pytest.approx(ref["literal_sum"], rel=1e-5)
    else:  # each window after the first averaged one label more than the guide counts
        assert ours["tokens"] == len(ids) - 1 == ref["literal_tokens"] + ref["windows"] - 1


def test_float64_tight_and_batch_invariant(setup):
    _, model, _, hf_dir, _, ids = setup
    model64 = copy.deepcopy(model).double()
    hf64 = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
    for max_length, stride in [(MAX, MAX // 2), (40, 40), (40, 13)]:
        ours = strided_eval(model64, ids, max_length=max_length, stride=stride, batch_size=4)
        one = strided_eval(model64, ids, max_length=max_length, stride=stride, batch_size=1)
        ref = guide_loop(hf64, ids, max_length, stride)
        assert ours["tokens"] == ref["tokens"]
        assert ours["nll_sum"] == pytest.approx(ref["nll_sum"], rel=1e-10)
        assert ours["nll_sum"] == pytest.approx(one["nll_sum"], rel=1e-12)  # right-padding leaks nothing
        np.testing.assert_array_equal(ours["correct"], one["correct"])


def test_accuracy_and_calibration_against_full_logits(setup):
    _, model, _, _, _, ids = setup
    short = ids[:50]
    out = strided_eval(model, short, max_length=len(short), stride=len(short))
    with torch.no_grad():
        logits = model(torch.tensor([short]))[0, :-1].float()  # (49, V)
    target = torch.tensor(short[1:])
    top1 = logits.argmax(-1) == target
    top5 = (logits.topk(5, -1).indices == target[:, None]).any(-1)
    assert out["tokens"] == len(short) - 1 and out["windows"] == 1
    assert out["top1"] == pytest.approx(top1.double().mean().item(), abs=1e-12)
    assert out["top5"] == pytest.approx(top5.double().mean().item(), abs=1e-12)
    assert 0 < out["top1"] < out["top5"] < 1
    np.testing.assert_array_equal(out["correct"], top1.numpy())
    np.testing.assert_allclose(out["confidence"], logits.softmax(-1).max(-1).values.double().numpy(),
                               rtol=1e-6)
    nll = F.cross_entropy(logits, target, reduction="sum").item()
    assert out["nll_sum"] == pytest.approx(nll, rel=1e-5)
    assert out["ece"] == expected_calibration_error(out["confidence"], out["correct"], 10)
    assert out["ece_adaptive"] == expected_calibration_error(out["confidence"], out["correct"], 10,
                                                             adaptive=True)


def test_bits_per_byte_by_hand(setup):
    tok, model, _, _, docs, _ = setup
    texts = [docs[0], "naïve café — ünïcode ✓ " + docs[1], docs[2]]
    ids = token_stream(tok, texts)
    nbytes = tok.token_byte_lengths()
    out = strided_eval(model, ids, max_length=MAX, stride=24, token_bytes=nbytes)
    assert nbytes[tok.eos_id] == 0
    assert out["bytes"] == sum(nbytes[i] for i in ids[1:]) == sum(len(t.encode("utf-8")) for t in texts)
    assert out["bpb"] == pytest.approx(out["nll_sum"] / math.log(2) / out["bytes"], rel=1e-12)
    assert out["bpb"] == pytest.approx(out["loss"] * out["tokens"] / math.log(2) / out["bytes"], rel=1e-12)


def test_stream_and_edges(setup):
    tok, model, _, _, docs, _ = setup
    ids = token_stream(tok, docs[:3])
    expect = [tok.eos_id]
    for d in docs[:3]:
        expect += tok.encode(d) + [tok.eos_id]
    assert ids == expect
    # a one-token window after disjoint ones predicts nothing: it is not run (the guide gets NaN there)
    out = strided_eval(model, ids[: 2 * 20 + 1], max_length=20, stride=20)
    assert (out["windows"], out["tokens"]) == (2, 38)
    model.train()
    strided_eval(model, ids, max_length=MAX, stride=MAX)
    assert model.training  # mode restored
    model.eval()
    with pytest.raises(ValueError, match="stride"):
        strided_eval(model, ids, max_length=32, stride=33)
    with pytest.raises(ValueError, match="max_seq_len"):
        strided_eval(model, ids, max_length=MAX + 1, stride=8)
    with pytest.raises(DataError, match="nothing to predict"):
        strided_eval(model, ids[:1], max_length=8, stride=8)


def test_read_texts_and_evaluate(setup, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok, model, _, _, docs, _ = setup
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text(docs[0])
    (d / "b.md").write_text(docs[1])
    (d / "c.jsonl").write_text(json.dumps({"text": docs[2]}) + "\n\n" + json.dumps({"text": "  "}) + "\n"
                               + json.dumps({"text": docs[3], "id": 1}) + "\n")
    pq.write_table(pa.table({"text": [docs[4], docs[5]]}), d / "d.parquet")
    (d / "e.bin").write_bytes(b"\x00\xff")
    (d / "sub" / "f.txt").write_text(docs[6])
    got = read_texts(d)
    assert [t for _, t in got] == docs[:7]
    assert [w.removeprefix(str(d)) for w, _ in got] == [
        "/a.txt", "/b.md", "/c.jsonl:1", "/c.jsonl:4", "/d.parquet:row 0", "/d.parquet:row 1", "/sub/f.txt"]
    assert read_texts(d / "c.jsonl") == got[2:4]

    out = evaluate_perplexity(model, tok, d, max_length=48, stride=24, batch_size=2)
    ref = strided_eval(model, token_stream(tok, docs[:7]), max_length=48, stride=24,
                       token_bytes=tok.token_byte_lengths())
    assert out["documents"] == 7 and (out["max_length"], out["stride"]) == (48, 24)
    assert out["nll_sum"] == pytest.approx(ref["nll_sum"], rel=1e-9)
    assert out["bytes"] == sum(len(t.encode("utf-8")) for t in docs[:7])
    assert evaluate_perplexity(model, tok, d / "a.txt")["stride"] == MAX // 2


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"text": "fine"}\n{"txt": "no"}\n', r"bad\.jsonl:2: record has no 'text' field \(fields: txt\)"),
        ('{"text": "fine"}\n\n{"text": 3}\n', r"bad\.jsonl:3: 'text' is a int, not a string"),
        ('{"text": "fine"}\n{"text": \n', r"bad\.jsonl:2: malformed JSON"),
        ('["text"]\n', r"bad\.jsonl:1: record has no 'text' field"),
        ('{"text": " "}\n', r"no text to evaluate on"),
    ],
)
def test_read_texts_bad_jsonl(tmp_path, content, match):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(DataError, match=match):
        read_texts(tmp_path / "bad.jsonl")


def test_read_texts_bad_inputs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pytest.raises(DataError, match="does not exist"):
        read_texts(tmp_path / "missing.txt")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.bin").write_bytes(b"x")
    with pytest.raises(DataError, match="no .txt, .md, .jsonl, .parquet files"):
        read_texts(tmp_path / "empty")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt: not valid UTF-8 at byte offset 3"):
        read_texts(tmp_path / "latin1.txt")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"t\.parquet:row 0: record has no 'text' field \(fields: body\)"):
        read_texts(tmp_path / "t.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        read_texts(tmp_path / "junk.parquet")
