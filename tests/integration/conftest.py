"""Fixtures the GGUF export tests (test_export_gguf*.py, helpers in gguf_models.py) share."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmforge.data.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A 300-token byte-level BPE with the chat template's two specials, the GGUF test models' tokenizer."""
    root = tmp_path_factory.mktemp("tok")
    text = ("the quick brown fox jumps over the lazy dog; hello world, 12345 times. " * 40
            + "pack my box with five dozen liquor jugs! ")
    tok = Tokenizer.train([text], 300, 2)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(root / "tok.json")
    return root / "tok.json"
