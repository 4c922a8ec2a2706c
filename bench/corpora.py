"""The corpora bench/planner_quality.py compares on, each as a folder of training text files plus one held-out
file scored whole:

- python: builtin:python (the docs and standard library of the running Python; the planner's rules were
  measured on it), its documents split by index: every 20th is held out.
- prose: English-like stories written by a seeded grammar below (characters, places, objects, actions,
  dialogue, numbers): license-clean by construction (this file is the whole source), reproducible to the
  byte, of any size, and nothing the planner or its rules ever saw. It is simpler than real prose (a
  vocabulary of a few hundred words), which the report says beside its numbers; its learning curve is a
  staircase (plateaus the model leaves at a step it cannot predict), so one run's bpb at a few minutes
  moves by 10-30% between runs of the same configuration.
- kjv: the King James Bible (public domain; 4.3M characters, 1,189 chapters, one document each, every
  20th held out), real English prose the planner never saw, taken from Debian's bible-kjv-text package
  (`apt-get download`, no root, nothing installed); the whole text whatever --chars says.

    python bench/corpora.py prose OUT_DIR --chars 2000000
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import subprocess
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


_CHAPTER = re.compile(r"^(?:[1-3] )?[A-Z][A-Za-z ]+ \d+$")  # "Genesis 1", "1 Samuel 3", "Song of Solomon 2"
_VERSE = re.compile(r"^ +(\d+) (.*)$")


def kjv_chapters(text: str) -> list[str]:
    """The chapters of `bible`'s plain output as documents: "Book N", a blank line, then one line per verse
    ("N text", its wrapped lines joined)."""
    chapters: list[list[str]] = []
    for line in text.splitlines():
        if _CHAPTER.match(line):
            chapters.append([line, ""])
        elif not chapters or not line.strip():
            continue
        elif m := _VERSE.match(line):
            chapters[-1].append(f"{m.group(1)} {m.group(2).strip()}")
        else:  # a wrapped verse goes on
            chapters[-1][-1] += " " + line.strip()
    return ["\n".join(c) + "\n" for c in chapters]


def kjv_text(work: Path) -> str:
    """The King James Bible (public domain) as `bible` prints it, from Debian's bible-kjv-text and bible-kjv
    packages (`apt-get download` and `dpkg-deb -x` into `work`: no root, nothing installed). SystemExit
    with the reason where apt-get, dpkg-deb or the packages are not there."""
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise SystemExit(f"corpus kjv needs {tool} (Debian's bible-kjv-text package): not on this "
                             "machine")
    work.mkdir(parents=True, exist_ok=True)
    got = subprocess.run(["apt-get", "download", "bible-kjv-text", "bible-kjv"], cwd=work,
                         capture_output=True, text=True)
    if got.returncode != 0:
        raise SystemExit(f"corpus kjv: apt-get download bible-kjv-text bible-kjv failed: "
                         f"{got.stderr.strip()[-300:]}")
    for deb in sorted(work.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "root")], check=True)
    lib = work / "root" / "usr" / "lib"
    out = subprocess.run([str(work / "root" / "usr" / "bin" / "bible"), "-p", str(lib), "gen1:1-rev22:21"],
                         capture_output=True, text=True, check=True, env={"COLUMNS": "80", "PATH": ""})
    return out.stdout


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
    if name == "kjv":
        docs = iter(kjv_chapters(kjv_text(out / "kjv-debs")))  # the whole text: 4.3M characters
    else:
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


def cut_train(train: Path, dest: Path, chars: int) -> Path:
    """A copy of `train` (a folder of .txt documents) holding its first documents by name up to `chars`
    characters in all (a document that would pass them is left out, later smaller ones still fit): the
    same corpus with less unique text, its held-out text unchanged. Written once."""
    if dest.is_dir():
        return dest
    part = dest.with_name(dest.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    total = 0
    for path in sorted(train.glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        if total + len(text) <= chars:
            (part / path.name).write_text(text, encoding="utf-8")
            total += len(text)
    part.rename(dest)
    return dest


CORPORA = ("python", "prose", "kjv")


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
