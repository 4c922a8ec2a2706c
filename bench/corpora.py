"""The corpora bench/planner_quality.py compares on, each as a folder of training text files plus one held-out
file scored whole:

- python: builtin:python (the docs and standard library of the running Python; the planner's rules were
  measured on it), its documents split by index: every 20th is held out.
- prose: English-like stories written by a seeded grammar below (characters, places, objects, actions,
  dialogue, numbers): license-clean by construction (this file is the whole source), reproducible to the
  byte, of any size, and nothing the planner or its rules ever saw. It is simpler than real prose (a
  vocabulary of a few hundred words), which the report says beside its numbers.

    python bench/corpora.py prose OUT_DIR --chars 2000000
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HELD_OUT_EVERY = 20  # every 20th document is held out

NAMES = ("Ada", "Basil", "Cora", "Dov", "Edith", "Felix", "Greta", "Hugo", "Iris", "Jonas", "Kira", "Leo",
         "Mira", "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Silas", "Tova", "Umar", "Vera", "Wim", "Yara")
PLACES = ("the old mill", "the harbour", "the market", "a narrow bridge", "the library", "the orchard",
          "the station", "a quiet square", "the river bank", "the bakery", "the hill above town", "the forge")
THINGS = ("a lantern", "a map", "a red kite", "a silver key", "a basket of pears", "a letter", "a compass",
          "a loaf of bread", "a wooden box", "a pair of boots", "a small bell", "a jar of honey", "a rope")
ADJ = ("tired", "curious", "cheerful", "worried", "patient", "brave", "quiet", "clever", "restless", "kind")
VERBS = ("carried", "found", "lost", "mended", "hid", "traded", "painted", "opened", "counted", "buried")
WEATHER = ("It was raining", "The wind was cold", "The sun was low", "Snow had fallen",
           "Fog lay on the water",
           "The morning was bright")
SAYS = ("said", "asked", "whispered", "called", "answered", "laughed")
LINES = ("Where did you put it?", "We should go before dark.", "I have never seen one like this.",
         "Count them again, please.", "It belongs to the miller.", "Nobody will believe us.",
         "Let us try once more.", "How much does it cost?", "Wait for me at the gate.")


def _sentence(rng: random.Random, who: str, other: str) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        return f"{rng.choice(WEATHER)} when {who} reached {rng.choice(PLACES)}."
    if kind == 1:
        return f"{who} {rng.choice(VERBS)} {rng.choice(THINGS)} and felt {rng.choice(ADJ)}."
    if kind == 2:
        return f'"{rng.choice(LINES)}" {rng.choice(SAYS)} {who}.'
    if kind == 3:
        n = rng.randint(2, 99)
        return f"{who} gave {other} {n} coins, and {other} gave back {rng.randint(1, n)}."
    if kind == 4:
        return f"Because {other} was {rng.choice(ADJ)}, {who} waited by {rng.choice(PLACES)}."
    return f"{who} and {other} {rng.choice(VERBS)} {rng.choice(THINGS)} near {rng.choice(PLACES)}."


def prose_documents(chars: int, seed: int = 0):
    """Stories of 3-9 paragraphs until `chars` characters are written."""
    rng, written, index = random.Random(seed), 0, 0
    while written < chars:
        who, other = rng.sample(NAMES, 2)
        paragraphs = [" ".join(_sentence(rng, *((who, other) if rng.random() < 0.6 else (other, who)))
                               for _ in range(rng.randint(2, 6))) for _ in range(rng.randint(3, 9))]
        doc = f"Story {index}: {who} and {other}\n\n" + "\n\n".join(paragraphs) + "\n"
        written += len(doc)
        index += 1
        yield doc


def python_documents(chars: int):
    sys.path.insert(0, str(REPO / "src"))
    from lmforge.config.schema import DataConfig
    from lmforge.data.sources import SourceStats, iter_documents

    yield from iter_documents(DataConfig(sources=["builtin:python"], max_chars=chars), SourceStats())


def materialize(name: str, out: Path, chars: int) -> tuple[Path, Path]:
    """(a folder of training .txt files, the held-out .txt file) of corpus `name`, written once."""
    train, held = out / name / "train", out / name / "heldout.txt"
    if held.is_file():
        return train, held
    docs = prose_documents(chars) if name == "prose" else python_documents(chars)
    train.mkdir(parents=True, exist_ok=True)
    kept = []
    for i, doc in enumerate(docs):
        if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1:
            kept.append(doc)
        else:
            (train / f"{i:06d}.txt").write_text(doc, encoding="utf-8")
    held.write_text("\n".join(kept), encoding="utf-8")
    return train, held


CORPORA = ("python", "prose")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=CORPORA)
    ap.add_argument("out")
    ap.add_argument("--chars", type=int, default=2_000_000)
    args = ap.parse_args()
    train, held = materialize(args.name, Path(args.out), args.chars)
    print(f"wrote {train} and {held}")


if __name__ == "__main__":
    main()
