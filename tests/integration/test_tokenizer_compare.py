"""`lmforge tokenizer compare`: the metrics on a hand-checked example, the CLI end to end with two kinds
(and a short training per tokenizer), and its refusals (exit 2, one line, nothing written)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from lmforge.data.tokenizer import Tokenizer
from lmforge.data.tokenizer_compare import MAX_TOKENIZERS, Spec, check_specs, measure, parse_train
from lmforge.errors import DataError


def _hand_wordpiece() -> Tokenizer:
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "a": 2, "b": 3, "##b": 4, "c": 5}
    hf = HFTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return Tokenizer(hf, 0)


def test_metrics_of_a_hand_checked_example():
    # "ab c" -> a ##b c (3 tokens, exact back); "a x" -> a [UNK] (decodes "a [UNK]": not exact)
    tok = _hand_wordpiece()
    assert tok.encode("ab c") == [2, 4, 5] and tok.encode("a x") == [2, 1]
    m = measure(tok, ["ab c", "a x"])
    assert m["encode_mb_per_s"] > 0
    del m["encode_mb_per_s"]
    assert m == {
        "documents": 2, "bytes": 7, "words": 4, "tokens": 5, "vocab_size": 6,
        "tokens_per_word": 5 / 4, "bytes_per_token": 7 / 5, "tokens_per_byte": 5 / 7,
        "vocab_used": 4 / 6,  # ids 1, 2, 4, 5 of 6
        "unknown_rate": 1 / 5, "round_trip": 1 / 2,
    }


def test_metrics_of_a_byte_level_bpe_without_unknowns():
    tok = Tokenizer.train(["hello world " * 20], 300)
    m = measure(tok, ["hello world", "héllo"], repeats=0)
    assert m["unknown_rate"] == 0.0 and m["round_trip"] == 1.0 and m["encode_mb_per_s"] is None
    assert m["bytes"] == 11 + 6 and m["words"] == 3
    assert m["tokens"] == len(tok.encode("hello world")) + len(tok.encode("héllo"))


def test_spec_parsing_and_bounds(tmp_path):
    assert parse_train("unigram:512", 8192) == Spec("unigram-512", kind="unigram", vocab_size=512)
    assert parse_train("wordpiece", 8192).vocab_size == 8192
    for bad, says in [("sentencepiece", "kind 'sentencepiece' is not one lmforge trains"),
                      ("bpe:lots", "'lots' is not a whole number"), ("bpe:10", "outside 260..1000000")]:
        with pytest.raises(DataError, match=says):
            parse_train(bad, 8192)
    with pytest.raises(DataError, match="nothing to compare"):
        check_specs([])
    with pytest.raises(DataError, match=f"compare at most {MAX_TOKENIZERS}"):
        check_specs([parse_train(f"bpe:{300 + i}", 0) for i in range(MAX_TOKENIZERS + 1)])
    with pytest.raises(DataError, match="bpe-300 is given twice"):
        check_specs([parse_train("bpe:300", 0)] * 2)
    with pytest.raises(DataError, match="no such file"):
        check_specs([Spec(str(tmp_path / "nope.json"), path=str(tmp_path / "nope.json"))])


def _corpus(root):
    root.mkdir()
    words = "def return import class value index tensor token window batch model layer train loss".split()
    for d in range(40):
        body = "\n".join(f"    {words[(d + i) % 14]} = {words[(d * i) % 14]}({i}, 'é')" for i in range(12))
        (root / f"d{d}.py.txt").write_text(f"def f{d}(x):\n{body}\n    return x\n", encoding="utf-8")
    return root


def _lmforge(*args, cwd):
    return subprocess.run([sys.executable, "-m", "lmforge", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_cli_compares_a_file_and_two_trained_kinds(tmp_path):
    src = _corpus(tmp_path / "docs")
    sets = ["--set", f"data.sources=[{src}]", "--set", "data.val_fraction=0.25"]
    file = tmp_path / "given.json"
    Tokenizer.train([p.read_text() for p in sorted(src.iterdir())], 320).save(file)
    r = _lmforge("tokenizer", "compare", *sets, "--tokenizer", str(file), "--train", "bpe:300",
                 "--train", "unigram:400", "--json", "--out", str(tmp_path / "report.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)  # stdout is the JSON alone; progress went to stderr
    assert report == json.loads((tmp_path / "report.json").read_text())
    rows = report["tokenizers"]
    assert list(rows) == [str(file), "bpe-300", "unigram-400"]
    assert [rows[k]["model"] for k in rows] == ["BPE", "BPE", "Unigram"]
    held = report["held_out"]
    assert held["documents"] > 0 and held["sources"] == "validation split of data.sources"
    for row in rows.values():  # byte-level BPE and a byte-fallback unigram: exact and nothing unknown
        assert row["round_trip"] == 1.0 and row["unknown_rate"] == 0.0
        assert row["tokens"] * row["bytes_per_token"] == pytest.approx(row["bytes"])
        assert row["documents"] == held["documents"] and 0 < row["vocab_used"] <= 1
    assert rows["bpe-300"]["vocab_size"] <= 300
    # the table form: one row per tokenizer
    r = _lmforge("tokenizer", "compare", *sets, "--train", "wordpiece:300", "--held-out", str(src),
                 cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "wordpiece-300" in r.stdout and "WordPiece" in r.stdout and "round trip" in r.stdout


@pytest.mark.parametrize("args, says", [
    (["--tokenizer", "missing.json"], "--tokenizer missing.json: no such file"),
    (["--train", "sentencepiece"], "kind 'sentencepiece' is not one lmforge trains"),
    ([], "nothing to compare"),
    (["--train", "bpe", "--work-dir", "w"], "--work-dir holds the --train-budget runs"),
    (["--train", "bpe", "--train-budget", "soon"], "--train-budget: 'soon' is not a duration"),
    (["--train", "bpe", "--held-out", "missing_dir"], "missing_dir"),
    (["--train", "bpe", "--out", "taken.json"], "taken.json already exists"),
])
def test_cli_refusals_exit_2_with_one_line(tmp_path, args, says):
    (tmp_path / "taken.json").write_text("mine")
    r = _lmforge("tokenizer", "compare", "--set", f"data.sources=[{tmp_path}]", *args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and r.stderr.startswith("lmforge tokenizer: error:")
    assert "Traceback" not in r.stderr
    assert (tmp_path / "taken.json").read_text() == "mine" and not (tmp_path / "w").exists()


def test_train_budget_reports_bits_per_byte_per_tokenizer(tmp_path):
    from lmforge.cli import main

    src = _corpus(tmp_path / "docs")
    work = tmp_path / "work"
    out = tmp_path / "report.json"
    tiny = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32",
            "train.micro_batch_size=4", "train.precision=fp32", f"data.sources=[{src}]",
            "data.val_fraction=0.25"]
    sets = [a for s in tiny for a in ("--set", s)]
    assert main(["tokenizer", "compare", *sets, "--train", "bpe:300", "--train", "wordpiece:300",
                 "--train-budget", "2s", "--work-dir", str(work), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["tokenizers"]
    for label in ("bpe-300", "wordpiece-300"):
        r = rows[label]
        assert r["steps"] >= 1 and math.isfinite(r["bpb"]) and 0 < r["bpb"] < 20
        # bits per byte of the held-out text (all of it scored: under --eval-chars): the loss summed
        # over its tokens, over its bytes, the same bytes for both tokenizers
        assert r["eval_bytes"] == r["bytes"] == rows["bpe-300"]["bytes"]
        assert r["bpb"] == pytest.approx(r["loss"] * r["eval_tokens"] / math.log(2) / r["bytes"])
        assert (work / "runs" / r["run"] / "config.yaml").is_file()
    assert [rows[k]["run"] for k in rows] == ["0-bpe-300", "1-wordpiece-300"]
