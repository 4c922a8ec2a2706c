"""`lmforge generate`: sample text from a run or checkpoint."""

from __future__ import annotations

import argparse
import sys

from lmforge.cli.numbers import number, whole
from lmforge.cli.verbs.base import Verb, config_args, quantized_args, run_path, weights_arg


def _arguments(p: argparse.ArgumentParser) -> None:
    config_args(p)
    weights_arg(p)
    p.add_argument("path", nargs="?", help="run dir or checkpoint dir (default: run.dir of -c)")
    p.add_argument("--prompt", help="text to continue (same as --set generate.prompt=...)")
    p.add_argument("--chat", action="store_true", help="the prompt is a user message: render it with "
                   "the run's chat template and print the assistant's reply")
    p.add_argument("--draft", metavar="PATH", help="speculative decoding: a smaller run, checkpoint "
                   "or Hugging Face dir with the same tokenizer proposes tokens that the model "
                   "verifies (same output distribution; acceptance statistics on stderr)")
    p.add_argument("--draft-k", type=number(whole(1, 64)), default=4, metavar="K",
                   help="--draft: tokens proposed per "
                   "forward of the model")
    quantized_args(p)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lmforge.eval.open_run import generate_text

    overrides = list(args.set)
    if args.prompt is not None:
        # Quote through YAML so any prompt text survives as a string.
        import json

        overrides.append(f"generate.prompt={json.dumps(args.prompt, ensure_ascii=False)}")
    console = Console(highlight=False)
    from lmforge.serve.quantized import model_preparer

    prepare = model_preparer(args.quantized, args.quant_path, args.memory_budget_mb,
                             say=lambda line: print(line, file=sys.stderr))
    texts = generate_text(run_path(args), overrides, weights=args.weights, chat=args.chat, draft=args.draft,
                          draft_k=args.draft_k, say=lambda line: print(line, file=sys.stderr),
                          prepare=prepare)
    for i, text in enumerate(texts):
        if i:
            console.rule()
        console.print(text, markup=False)
    return 0


GENERATE = Verb("generate", "sample text from a run or checkpoint", _arguments, _run)
