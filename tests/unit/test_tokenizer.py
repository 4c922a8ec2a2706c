import json
import random
import textwrap
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from lmforge.data.tokenizer import EOS_TOKEN, Tokenizer
from lmforge.errors import DataError

WORDS = "data flows from text to tokens then shards feed the model which learns to predict".split()
CODE = textwrap.dedent('''\
    def greet(name: str) -> str:
        """Say hello."""
        return f"hello, {name}!"   # trailing spaces\x20\x20
    ''')
SAMPLES = [
    "plain ASCII text, with punctuation: (a+b)*c = 42; done.",
    "emoji 😀🚀👩‍👩‍👧, CJK 漢字かなカナ한국어, accents é and e\u0301 (combining), RTL עברית",
    "whitespace   runs\t\ttabs\n\n\nnewlines \r\n windows   \u00a0nbsp",
    CODE,
    "a literal " + EOS_TOKEN + " inside text is text",
    "",
    " leading space and trailing space ",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(200)] + [CODE] * 20
    texts.append(Path(textwrap.__file__).read_text(encoding="utf-8"))  # real code: enough for 400 ids
    return Tokenizer.train(texts, vocab_size=400, min_frequency=2)


def test_trained_vocab_and_eos(tok):
    assert tok.vocab_size == 400
    assert tok.eos_id == tok.hf.token_to_id(EOS_TOKEN)
    assert tok.decode([tok.eos_id]) == EOS_TOKEN


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_any_text(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.eos_id not in ids  # documents never produce control tokens


def test_merges_learned(tok):
    # a frequent training word becomes one token, i.e. the BPE did learn merges
    assert len(tok.encode(" tokens")) == 1 and len(tok.encode("tokens tokens")) < len("tokens tokens")


def test_encode_batch_matches_encode(tok):
    assert tok.encode_batch(SAMPLES) == [tok.encode(s) for s in SAMPLES]


def test_token_byte_lengths_sum_to_utf8_length(tok):
    lengths = tok.token_byte_lengths()
    assert lengths.shape == (tok.vocab_size,) and lengths.dtype == np.int64
    assert lengths[tok.eos_id] == 0
    for text in SAMPLES:
        assert lengths[tok.encode(text)].sum() == len(text.encode("utf-8"))


def test_save_load_round_trip(tok, tmp_path):
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]  # no temp file left
    loaded = Tokenizer.load(path)
    assert loaded.eos_id == tok.eos_id and loaded.vocab_size == tok.vocab_size
    assert [loaded.encode(s) for s in SAMPLES] == [tok.encode(s) for s in SAMPLES]
    assert Tokenizer.load(tmp_path).vocab_size == tok.vocab_size  # a folder holding tokenizer.json


def _word_level(tmp_path, vocab: dict, special: list[str]):
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(special)
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    return path


def test_load_finds_sentencepiece_style_eos_and_byte_lengths(tmp_path):
    path = _word_level(tmp_path, {"<unk>": 0, "</s>": 1, "\u2581hello": 2, "<0x0A>": 3, "é": 4}, ["</s>"])
    tok = Tokenizer.load(path)
    assert tok.eos_id == 1
    assert tok.token_byte_lengths().tolist() == [5, 0, 6, 1, 2]


def test_load_eos_from_tokenizer_config(tmp_path):
    path = _word_level(tmp_path, {"<unk>": 0, "<|im_end|>": 1, "hi": 2}, ["<|im_end|>"])
    with pytest.raises(DataError, match="no end-of-document token"):
        Tokenizer.load(path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    assert Tokenizer.load(path).eos_id == 1


def test_load_errors_are_clear(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        Tokenizer.load(tmp_path / "missing.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="not a valid tokenizer.json"):
        Tokenizer.load(bad)
