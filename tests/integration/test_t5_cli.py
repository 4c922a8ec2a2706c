"""A T5 model through the CLI: `lmforge import` of a T5ForConditionalGeneration dir (with a T5-style
SentencePiece/Unigram tokenizer built offline), `lmforge generate --prompt` (input text -> output text,
greedy equal to transformers' generate), `lmforge export` back (transformers loads it, same logits), and
what a T5 run cannot do yet refused with exit 2 and one line, no traceback. An imported T5 run's
objective is span corruption (what it pretrained with)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity"))

from test_t5_hf import V, hf_model  # noqa: E402

from lmforge.cli import main  # noqa: E402
from lmforge.data import Tokenizer  # noqa: E402

WORDS = ("the cat sat on mat dog ran far away big small red blue green house tree bird sky sun moon star "
         "fish sea boat road car walk talk eat").split()


def t5_tokenizer():
    """A Unigram tokenizer laid out like T5's: <pad> 0, </s> 1, <unk> 2, Metaspace pieces, EOS appended."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors

    pieces = [f"\u2581{w}" for w in WORDS] + list("abcdefghijklmnopqrstuvwxyz") + ["\u2581"]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(p, -1.0 - i / 100) for i, p in enumerate(pieces)]
    vocab += [(f"<x{i}>", -50.0) for i in range(V - len(vocab))]  # pad the table to the model's vocabulary
    tok = HFTokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok.add_special_tokens(["<pad>", "</s>", "<unk>"])
    return tok


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> tuple[Path, Path, object]:
    root = tmp_path_factory.mktemp("t5")
    hf = hf_model("t5", num_decoder_layers=2)
    hf.save_pretrained(root / "hf")
    t5_tokenizer().save(str(root / "hf" / "tokenizer.json"))
    assert main(["import", str(root / "hf"), str(root / "run")]) == 0
    assert "name: span_corruption" in (root / "run" / "config.yaml").read_text()
    return root, root / "run", hf


def test_generate_is_transformers_greedy(imported, capsys):
    root, run, hf = imported
    prompt = "the cat sat on the mat"
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", prompt, "--set", "generate.temperature=0",
                 "--set", "generate.max_new_tokens=10"]) == 0
    out = capsys.readouterr().out.strip()
    tok = Tokenizer.load(root / "hf" / "tokenizer.json")
    ids = t5_tokenizer().encode(prompt).ids
    assert ids[-1] == 1 and tok.eos_id == 1  # T5's input ends with </s>
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=10, do_sample=False, num_beams=1)
    new = [t for t in want[0, 1:].tolist() if t not in (0, 1)]
    assert new and out == tok.decode(new).strip()
    # the Hugging Face dir itself, without an import
    assert main(["generate", str(root / "hf"), "--prompt", prompt, "--set", "generate.temperature=0",
                 "--set", "generate.max_new_tokens=10"]) == 0
    assert capsys.readouterr().out.strip() == out


def test_export_loads_in_transformers(imported, tmp_path, capsys):
    root, run, hf = imported
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    back = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.tensor([t5_tokenizer().encode("big red boat").ids])
    dec = torch.tensor([[0, 5, 9, 14]])
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids, decoder_input_ids=dec).logits,
                                   hf(input_ids=ids, decoder_input_ids=dec).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("args", "message"), [
    (["eval", "data", "{run}", "--data", "{tmp}/x.txt"], "this command (it runs decoder models) is not "
     "available for an encoder-decoder (model.arch=t5) yet"),
    (["generate", "{run}", "--prompt", "x", "--draft", "{run}"],
     "--draft: not available for an encoder-decoder"),
    (["train", "-c", "{run}/config.yaml", "--set", "run.dir={tmp}/r2", "--set", "parallel.pp=2"],
     "parallel.pp=2 is not available"),
    (["generate", "{run}"], "set generate.prompt"),
])
def test_what_t5_cannot_do_yet_exits_2(imported, tmp_path, capsys, args, message):
    _, run, _ = imported
    args = [a.format(run=run, tmp=tmp_path) for a in args]
    (tmp_path / "x.txt").write_text("some text to score\n")
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
