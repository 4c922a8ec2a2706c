"""Hugging Face at the edges, end to end: export a trained run and load it in transformers; import an
HF model, evaluate / generate / continue training from it; use an HF dir directly."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import CORPUS, TINY, tiny_overrides
from lmforge.checkpoint.hf_io import export_hf, import_hf
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.data import Tokenizer, prepare
from lmforge.eval.open_run import evaluate, generate_text, load_run
from lmforge.train.trainer import Trainer, train

transformers = pytest.importorskip("transformers")


@pytest.fixture
def hf_llama(tmp_path, shared_data_dir):
    """A tiny random Llama saved by transformers, with the debug corpus's tokenizer next to it."""
    cfg = load_config(TINY, tiny_overrides(tmp_path / "prep", shared_data_dir))
    tok = prepare(cfg, console=lambda *_: None).tokenizer
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=48, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(hf_cfg)
    out = tmp_path / "hf_llama"
    model.save_pretrained(out)
    tok.save_hf(out, model_max_length=64)
    return out, model.eval(), tok


class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_trained_run_exports_to_transformers_with_equal_logits(tiny_cfg, tmp_path):
    train(tiny_cfg("train.max_steps=3", "checkpoint.every=3"))
    out = export_hf(tmp_path / "run", tmp_path / "hf", say=lambda *_: None)
    capture = Capture()
    hf_logger = logging.getLogger("transformers")  # does not propagate to the root logger
    hf_logger.addHandler(capture)
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    finally:
        hf_logger.removeHandler(capture)
    assert capture.messages == []  # no missing / unexpected / newly initialised weights, no warning at all
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert gen.eos_token_id == hf_tok.eos_token_id
    run = load_run(tmp_path / "run")
    text = "def add(a, b):\n    return a + b\n"
    ids = run.tokenizer.encode(text)
    assert hf_tok.encode(text) == ids
    x = torch.tensor([ids])
    with torch.no_grad():
        ours, theirs = run.model(x), hf(x).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert main(["export", str(tmp_path / "run"), str(out)]) == 2  # refuses a non-empty dir


def test_import_then_eval_generate_and_continue_training(hf_llama, tmp_path, shared_data_dir, capsys):
    hf_dir, hf_model, tok = hf_llama
    out = tmp_path / "imported"
    assert main(["import", str(hf_dir), str(out)]) == 0
    import lmforge

    direct = lmforge.from_hf(hf_dir)  # the contract: from_hf(path) -> model(input_ids) -> logits
    x0 = torch.tensor([tok.encode("hello")])
    with torch.no_grad():
        torch.testing.assert_close(direct(x0), hf_model(x0).logits, atol=1e-5, rtol=0)
    lmforge.to_hf(direct, tmp_path / "again")
    assert (tmp_path / "again" / "config.json").is_file()
    run = load_run(out)
    assert run.step == 0 and run.cfg.model.n_kv_heads == 3 and run.cfg.model.tie_embeddings is False
    x = torch.tensor([tok.encode("import sys\nprint(sys.argv)")])
    with torch.no_grad():
        torch.testing.assert_close(run.model(x), hf_model(x).logits, atol=1e-5, rtol=0)
    eval_data = [f"data.dir={tmp_path / 'eval_data'}", f"data.sources=[{CORPUS}]", "data.max_chars=null"]
    assert evaluate(out, ["eval.max_batches=2", *eval_data], say=lambda *_: None)["loss"] > 0
    assert generate_text(out, ["generate.prompt=import", "generate.max_new_tokens=8"])[0].startswith("import")
    # continued pre-training from the imported weights: the architecture and tokenizer come with them
    cfg = load_config(TINY, tiny_overrides(tmp_path / "cont", tmp_path / "cont_data", "model.preset=null",
                                           f"model.init_from={out}", "train.max_steps=2"))
    trainer = Trainer(cfg)
    for (k, a), b in zip(trainer.model.state_dict().items(), run.model.state_dict().values()):
        assert torch.equal(a, b), k
    trainer.fit()
    # the HF dir works directly too, without an import step
    capsys.readouterr()
    assert main(["generate", str(hf_dir), "--prompt", "x", "--set", "generate.max_new_tokens=4"]) == 0
    assert capsys.readouterr().out.startswith("x")


def test_init_from_rejects_contradicting_architecture(hf_llama, tmp_path, capsys):
    hf_dir, _, _ = hf_llama
    code = main(["train", "-c", str(TINY), "--set", f"run.dir={tmp_path / 'r'}", "--set",
                 f"model.init_from={hf_dir}", "--set", "model.n_layers=5"])
    assert code == 2 and "model.n_layers=5" in capsys.readouterr().err


def test_import_refuses_non_hf_dir_and_nonempty_out(tmp_path, hf_llama, capsys):
    hf_dir, _, _ = hf_llama
    assert main(["import", str(tmp_path), str(tmp_path / "o")]) == 2
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep.txt").write_text("x")
    assert main(["import", str(hf_dir), str(tmp_path / "o")]) == 2
    assert (tmp_path / "o" / "keep.txt").read_text() == "x"
    import_hf(hf_dir, tmp_path / "o", overwrite=True, say=lambda *_: None)
    assert Tokenizer.load(tmp_path / "o" / "tokenizer.json").vocab_size > 0
