"""data.tokenizer.kind: bpe | wordpiece | unigram trained, round-tripped, counted in bytes, prepared into
shards and exported so that transformers encodes alike; GGUF export refuses the kinds it cannot write."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from lmforge.data.prepare import _PIECE_CHARS, _pieces
from lmforge.data.tokenizer import EOS_TOKEN, KINDS, UNK_TOKENS, Tokenizer
from lmforge.errors import DataError, LmforgeError

WORDS = ("def return import class value index tensor token window batch model layer train "
         "loss step print self None True False lambda yield while for if else").split()


def _corpus() -> list[str]:
    rng = np.random.default_rng(0)
    docs = []
    for d in range(60):
        lines = [f"def f{d}(x, y):"]
        for _ in range(8):
            ws = rng.choice(WORDS, size=5)
            lines.append("    " + " ".join(ws) + f" = x[{int(rng.integers(100))}]  # Übung café")
        docs.append("\n".join(lines) + "\n\treturn x\n")
    return docs


@pytest.fixture(scope="module")
def toks() -> dict[str, Tokenizer]:
    return {k: Tokenizer.train(_corpus(), 400, 2, kind=k) for k in KINDS}


# text none of the tokenizers saw: other scripts, emoji, tabs, runs of spaces, a leading space, and the
# text of control and byte-fallback tokens, which must stay plain text
HARD = [" leading space", "tab\there\r\nand  two  spaces ", "漢字 and 🎉 emoji, ünïcødé",
        "literal <|endoftext|> and <unk> and <0x41> and [UNK]", "", "x"]


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_exact_round_trip_and_nothing_unknown(toks, kind):
    tok = toks[kind]
    unk = tok.token_id(UNK_TOKENS.get(kind, "")) if kind in UNK_TOKENS else None
    for text in HARD + _corpus()[:3]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.eos_id not in ids  # text never makes the end-of-document token
        assert unk is None or unk not in ids
    if kind == "unigram":  # the literal "<0x41>" stays five characters, not the byte token of "A"
        assert tok.token_id("<0x41>") not in tok.encode("<0x41>")


def test_wordpiece_loses_whitespace_and_spells_unknown_words_as_unk(toks):
    tok = toks["wordpiece"]
    # decoding puts one space between words (punctuation is a word of its own): whitespace is lost
    assert tok.decode(tok.encode("def f(x, y):\n\treturn  x")) == "def f ( x , y ) : return x"
    ids = tok.encode("return 漢字 x")
    assert tok.token_id("[UNK]") in ids and tok.decode(ids) == "return [UNK] [UNK] x"
    assert tok.eos_id not in tok.encode("literal <|endoftext|>")


@pytest.mark.parametrize("kind", KINDS)
def test_vocab_eos_first_and_size(toks, kind):
    tok = toks[kind]
    assert tok.eos_id == 0 and tok.hf.id_to_token(0) == EOS_TOKEN
    assert tok.model_type == {"bpe": "BPE", "wordpiece": "WordPiece", "unigram": "Unigram"}[kind]
    assert tok.vocab_size <= 400
    if kind == "unigram":  # the 256 byte tokens are the last ids, inside the vocabulary size
        assert [tok.token_id(f"<0x{b:02X}>") for b in (0, 255)] == [tok.vocab_size - 256, tok.vocab_size - 1]


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_token_bytes_sum_to_the_text_bytes(toks, kind):
    tok = toks[kind]
    lengths = tok.token_byte_lengths()
    for text in HARD[:4] + _corpus()[:2]:
        ids = tok.encode(text)
        assert int(lengths[ids].sum()) == len(text.encode("utf-8")), text


def test_wordpiece_token_bytes_are_the_non_whitespace_bytes(toks):
    tok = toks["wordpiece"]
    lengths = tok.token_byte_lengths()
    later = [(t, i) for t, i in tok.hf.get_vocab().items() if t.startswith("##")]
    assert later and all(lengths[i] == len(t[2:].encode("utf-8")) for t, i in later)  # "##" is no text
    for text in _corpus()[:3] + ["def f(x, y):\n\treturn  x"]:
        norm = tok.hf.normalizer.normalize_str(text)
        assert int(lengths[tok.encode(text)].sum()) == len("".join(norm.split()).encode("utf-8"))
    assert lengths[tok.token_id("[UNK]")] == 0 and lengths[tok.eos_id] == 0


@pytest.mark.parametrize("kind", ["wordpiece", "unigram"])
def test_long_document_pieces_encode_as_the_whole(toks, kind):
    """prepare encodes a document over 1M characters in pieces cut before whitespace: the ids must be
    those of the whole document, for every kind (here with pieces of _PIECE_CHARS)."""
    tok = toks[kind]
    doc = "".join(_corpus()) * 3
    assert len(doc) > 3 * _PIECE_CHARS
    pieces = list(_pieces(doc))
    assert len(pieces) > 3
    assert [i for p in pieces for i in tok.encode(p)] == tok.encode(doc)


@pytest.mark.parametrize("kind", KINDS)
def test_hf_export_encodes_and_decodes_alike_with_chat_tokens(toks, kind, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = Tokenizer.of(Tokenizer.train(_corpus(), 400, 2, kind=kind).hf)  # a copy: tokens get added
    start, end = tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save_hf(tmp_path, model_max_length=128)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf.eos_token_id == tok.eos_id
    assert (hf.unk_token if kind != "bpe" else None) == UNK_TOKENS.get(kind)
    for text in _corpus()[:2] + HARD[:3]:
        ids = tok.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids
        assert hf.decode(ids) == tok.decode(ids)
    chat = "<|im_start|>user\nreturn x<|im_end|>\n"
    ids, _ = tok.encode_chat(chat)
    assert ids[0] == start and end in ids
    assert hf.encode(chat, add_special_tokens=False) == ids


@pytest.mark.parametrize("kind", ["wordpiece", "unigram"])
def test_gguf_export_refuses_the_kinds_llama_cpp_cannot_run(toks, kind, tmp_path):
    from lmforge.export.gguf_vocab import read_vocab

    toks[kind].save_hf(tmp_path, model_max_length=128)
    with pytest.raises(LmforgeError, match=f"model type '{toks[kind].model_type}' is not supported by GGUF"):
        read_vocab(tmp_path, toks[kind].vocab_size)


def test_an_unknown_kind_is_refused():
    with pytest.raises(DataError, match="tokenizer kind 'sentencepiece' is not one lmforge trains; give one "
                                        "of bpe, wordpiece, unigram"):
        Tokenizer.train(["a b"], 300, kind="sentencepiece")


def _lmforge(*args, cwd):
    return subprocess.run([sys.executable, "-m", "lmforge", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_prepare_with_unigram_and_config_refusals(tmp_path):
    src = tmp_path / "docs"
    src.mkdir()
    for i, doc in enumerate(_corpus()):
        (src / f"d{i}.txt").write_text(doc, encoding="utf-8")
    common = ["--set", f"data.sources=[{src}]", "--set", f"run.dir={tmp_path / 'run'}",
              "--set", "data.tokenizer.vocab_size=400", "--set", "data.val_fraction=0.2"]
    r = _lmforge("prepare", *common, "--set", "data.tokenizer.kind=unigram", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "training a Unigram (vocab 400)" in r.stdout
    data = tmp_path / "run" / "data"
    meta = json.loads((data / "meta.json").read_text())
    assert meta["settings"]["tokenizer"]["kind"] == "unigram"
    from lmforge.data.prepare import load_prepared
    from lmforge.data.shards import open_shard

    prepared = load_prepared(data)
    assert prepared.tokenizer.model_type == "Unigram"
    train = np.concatenate([np.asarray(open_shard(s)) for s in prepared.shards("train")])
    # one EOS after each document, and the shards decode back to the documents exactly
    docs = prepared.tokenizer.decode(train.tolist()).split(EOS_TOKEN)
    assert docs[-1] == "" and set(docs[:-1]) <= set(_corpus())
    assert (train == prepared.tokenizer.eos_id).sum() == meta["splits"]["train"]["documents"]
    # the default kind leaves a BPE's data fingerprint as it was before the key existed
    from lmforge.config.load import load_config
    from lmforge.data.prepare import _settings

    assert "kind" not in _settings(load_config(None, [f"data.sources=[{src}]"]))["tokenizer"]
    # refused before any work, naming the key, exit 2; the prepared data is untouched
    before = (data / "meta.json").read_bytes()
    for bad, says in [("data.tokenizer.kind=sentencepiece", "should be 'bpe', 'wordpiece' or 'unigram'"),
                      ("data.tokenizer.min_frequency=5", "min_frequency=5 is a BPE / WordPiece merge")]:
        r = _lmforge("prepare", *common, "--set", "data.tokenizer.kind=unigram", "--set", bad, cwd=tmp_path)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = _lmforge("prepare", *common, "--set", "data.tokenizer.kind=wordpiece", "--set",
                 f"data.tokenizer.path={data / 'tokenizer.json'}", cwd=tmp_path)
    assert r.returncode == 2 and "drop one of the two" in r.stderr
    assert (data / "meta.json").read_bytes() == before


def test_python_api_trains_the_configured_kind(tmp_path, capsys):
    """Texts handed to lmforge.Trainer without a tokenizer train one of data.tokenizer.kind too."""
    import torch
    from torch import nn

    import lmforge

    class Tiny(nn.Module):
        def __init__(self, vocab: int) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(vocab, 16), nn.Linear(16, vocab)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(ids))

    cfg = {"run": {"dir": str(tmp_path / "run")},
           "data": {"tokenizer": {"vocab_size": 400, "kind": "unigram"}},
           "schedule": {"name": "constant", "warmup_steps": 0}, "checkpoint": {"every": 0},
           "train": {"max_steps": 2, "seq_len": 32, "micro_batch_size": 2, "precision": "fp32",
                     "eval_every": 0}}
    trainer = lmforge.Trainer(model=Tiny(400), train_data=_corpus(), config=cfg)
    trainer.fit()
    assert "training a 400-token Unigram" in capsys.readouterr().out
    assert trainer.run.tokenizer.model_type == "Unigram"
