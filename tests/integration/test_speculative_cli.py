"""`lmforge generate --draft`: speculative decoding from the command line on a tiny trained run."""

from __future__ import annotations

import re

from lmforge.cli import main
from lmforge.train.trainer import train


def test_generate_with_a_draft_prints_text_and_acceptance_stats(tiny_cfg, tmp_path, capsys):
    train(tiny_cfg("train.max_steps=4", "checkpoint.every=4"))
    run = str(tmp_path / "run")
    base = ["generate", run, "--prompt", "def ", "--set", "generate.max_new_tokens=12"]
    # The run as its own draft: the stats line goes to stderr, the text to stdout.
    assert main([*base, "--draft", run, "--draft-k", "3", "--set", "generate.temperature=0"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("def ")
    stats = re.search(r"speculative decoding: (\d+)/(\d+) drafted tokens accepted .*, 12 tokens in", out.err)
    assert stats and int(stats[2]) > 0 and int(stats[1]) <= int(stats[2])
    # Sampling, two samples: both printed (a rule between them), one stats line for both.
    sampled = ["--set", "generate.num_samples=2", "--set", "generate.temperature=1"]
    assert main([*base, "--draft", run, *sampled]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("def ") and "\u2500" in out.out and ", 24 tokens in" in out.err
    # A draft that is not a run is refused with a message, not a traceback.
    assert main([*base, "--draft", str(tmp_path / "nope")]) == 2
    assert "nope" in capsys.readouterr().err
