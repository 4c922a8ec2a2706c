"""Small verifiable instruction tasks: chat data for SFT of small models, rewards for RL and an
exact-match evaluation, all generated here (nothing is downloaded).

Each task family (data/task_families.py, the registry `TASKS`) makes one (prompt, answer) pair from a
seeded `random.Random` and a difficulty (1 is the easiest non-trivial instance; each family's docstring
says what it scales). Answers are computed by construction, never by `eval()`, and are short exact
strings. This module turns families into records (SFT chat, preference pairs, unpaired, prompt-disjoint
splits), writes them, and scores generations.

Prompts share one shape so a small model learns the format once: an instruction, then a colon and the
data last (`Reverse the letters: kqzt`), or a short question (`What is 34 + 58?`).

Two more families are safety data (data/safety_tasks.py), generated only when named (`--tasks
refuse,benign`): `refuse` (harmful requests answered by a refusal) and `benign` (harmless look-alikes
answered helpfully). Their records also carry the request's `category`, and they are scored by whether
the reply refuses, not by exact wording.

Determinism: record i of `generate(..., seed)` comes from its own `random.Random` seeded with a string
naming (stream, seed, i). String seeds go through SHA-512 and the methods used here (`randint`,
`choice`, `sample`, `shuffle`, `random`) draw the same numbers on every machine and Python >= 3.10;
`hash()` is never used (it is salted per process).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# The families and their registry live in task_families; re-exported here, where callers import them.
from lmforge.data.task_families import TASKS, TaskFamily, register, task_names  # noqa: F401
from lmforge.errors import ConfigError, DataError, LmforgeError
from lmforge.utils.io import atomic_write_text

# Where a generated answer ends besides a newline: end-of-turn / end-of-text markers of common chat
# templates (a model trained with any of them may emit its marker right after the answer).
EOT_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>", "</s>",
               "<end_of_turn>")


# ---- generation -------------------------------------------------------------------------------------

def _family(name: str) -> TaskFamily:
    if name not in TASKS:
        raise ConfigError(f"unknown instruction task {name!r}; valid tasks: {', '.join(TASKS)}")
    return TASKS[name]


def _resolve_tasks(tasks: Sequence[str] | str | None) -> list[str]:
    if tasks is None:
        return task_names()
    if isinstance(tasks, str):  # "add,sub" from a command line
        tasks = [t.strip() for t in tasks.split(",") if t.strip()]
    names = list(tasks)
    if not names:
        raise ConfigError(f"no instruction tasks given; choose from: {', '.join(TASKS)} (or None for all)")
    for name in names:
        _family(name)
    return names


def _resolve_difficulty(difficulty: int | dict[str, int], names: list[str]) -> dict[str, int]:
    if isinstance(difficulty, dict):
        for name in difficulty:
            _family(name)
        levels = {name: difficulty.get(name, 1) for name in names}
    else:
        levels = {name: difficulty for name in names}
    for name, level in levels.items():
        top = TASKS[name].max_difficulty
        if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= top:
            raise ConfigError(f"difficulty for task {name!r} is {level!r}; give an integer from 1 to {top}")
    return levels


def _records(tasks, n: int, seed: int, difficulty, system: str | None, stream: str, start: int = 0
             ) -> list[dict]:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"number of instruction records n={n!r}; give an integer >= 0")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed={seed!r} for instruction tasks; give an integer")
    names = _resolve_tasks(tasks)
    levels = _resolve_difficulty(difficulty, names)
    out = []
    for i in range(start, start + n):
        name = names[i % len(names)]  # round robin: every family equally often, evenly spread
        rng = random.Random(f"lmforge.instruct_tasks/{stream}/{seed}/{i}")
        prompt, answer, extra = TASKS[name].make_record(rng, levels[name])
        messages = [{"role": "system", "content": system}] if system else []
        messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        out.append({"messages": messages, "task": name, "answer": answer, "difficulty": levels[name],
                    **extra})
    return out


def generate(tasks: Sequence[str] | None, n: int, seed: int, difficulty: int | dict[str, int] = 1,
             system: str | None = None) -> list[dict]:
    """`n` chat records cycling through `tasks` (None: every default family, i.e. all but the safety
    ones; a name may repeat to weight it).

    Each record is {"messages": [system (if `system` is non-empty), user prompt, assistant answer],
    "task", "answer", "difficulty"} (+ "category" for `refuse` / `benign`). `difficulty` is one level
    for all or {task: level} (missing: 1).
    The same arguments give the same records everywhere, and record i does not depend on `n`.
    """
    return _records(tasks, n, seed, difficulty, system, stream="train")


def select(tasks: Sequence[str] | None, n: int, seed: int, difficulty: int | dict[str, int] = 1,
           system: str | None = None, *, unique: bool = False, exclude: Iterable[str] = ()) -> list[dict]:
    """Up to `n` records of `generate`'s stream, skipping every record whose prompt is in `exclude`
    (and, with `unique`, every prompt already taken): for prompt-disjoint sets over small task spaces
    (one-digit sums have 100 prompts), e.g. a held-out file, then RL prompts excluding it, then SFT
    data excluding both. Fewer than `n` come back when the stream runs out of new prompts (it is
    read up to 20 x n + 1,000 records)."""
    excluded, seen, out = set(exclude), set(), []
    budget = 20 * n + 1000
    for start in range(0, budget, 1000):
        for r in _records(tasks, min(1000, budget - start), seed, difficulty, system, "train", start):
            prompt = prompt_of(r)
            if prompt in excluded or (unique and prompt in seen):
                continue
            seen.add(prompt)
            out.append(r)
            if len(out) == n:
                return out
    return out


def wrong_answer(name: str, rng: random.Random, difficulty: int, answer: str) -> str:
    """A wrong answer in the family's own format: the answer of another instance of the same task
    (drawn from `rng`) that differs from `answer` after the family's normalisation, so it would score
    0. A plausible near miss, which is what a preference pair should contrast, not random noise. The
    safety families contrast behaviours instead: a refusal against compliance (see `TaskFamily.wrong`)."""
    return _family(name).wrong(rng, difficulty, answer)


def pairs_of(records: Sequence[dict], seed: int) -> list[dict]:
    """Preference records in TRL's conversational shape from task records (`generate`,
    `split_disjoint`): {"prompt": [system?, user], "chosen": [assistant: the exact answer], "rejected":
    [assistant: a wrong answer of the same task, see `wrong_answer`], "task", "answer", "difficulty"}
    (+ the record's other fields, e.g. "category"). The wrong answer of a record depends on (seed, its
    prompt) alone."""
    out = []
    for rec in records:
        prompt, answer = rec["messages"][:-1], rec["messages"][-1]
        key = json.dumps(prompt, sort_keys=True)
        rng = random.Random(f"lmforge.instruct_tasks/rejected/{seed}/{key}")
        wrong = wrong_answer(rec["task"], rng, rec["difficulty"], rec["answer"])
        rejected = [{"role": "assistant", "content": wrong}]
        rest = {k: v for k, v in rec.items() if k != "messages"}  # task, answer, difficulty, ...
        out.append({"prompt": prompt, "chosen": [answer], "rejected": rejected, **rest})
    return out


def unpaired_of(pairs: Sequence[dict]) -> list[dict]:
    """KTO's unpaired records from preference records (TRL's `unpair_preference_dataset`): each pair
    gives {"prompt", "completion": chosen, "label": true} and {"prompt", "completion": rejected,
    "label": false}, in that order, with the pair's other fields."""
    out = []
    for p in pairs:
        extra = {k: v for k, v in p.items() if k not in ("prompt", "chosen", "rejected")}
        out.append({"prompt": p["prompt"], "completion": p["chosen"], "label": True, **extra})
        out.append({"prompt": p["prompt"], "completion": p["rejected"], "label": False, **extra})
    return out


def generate_pairs(tasks: Sequence[str] | None, n: int, seed: int, difficulty: int | dict[str, int] = 1,
                   system: str | None = None) -> list[dict]:
    """`n` preference records (see `pairs_of`) with the prompts and answers of `generate(...)` with the
    same arguments, so pairs and SFT data from one seed share prompts."""
    return pairs_of(generate(tasks, n, seed, difficulty, system), seed)


def prompt_of(record: dict) -> str:
    """The user prompt of a record (an SFT record's messages or a preference record's prompt)."""
    return next(m["content"] for m in record.get("messages") or record["prompt"] if m["role"] == "user")


def prompts_in(paths: Iterable[str | Path]) -> set[str]:
    """The user prompts of the chat / preference records in `paths` (JSONL, Parquet or saved datasets
    dirs); a record without one is an error naming its file and line."""
    from lmforge.data.chat import BadRow, ChatStats, iter_records

    out: set[str] = set()
    for path in paths:
        path = Path(path)
        if not path.exists():
            raise DataError(f"{path}: no such file or dir (a JSONL file of records whose prompts to exclude)")
        for _, rows in iter_records(path, ChatStats()):
            for where, record in rows:
                if isinstance(record, BadRow):
                    raise DataError(f"{where}: {record.why}")
                try:
                    plain = record.get("prompt") if isinstance(record, dict) else None
                    prompt = plain if isinstance(plain, str) else prompt_of(record)
                except (KeyError, TypeError, AttributeError, StopIteration):
                    prompt = None
                if not isinstance(prompt, str):
                    raise DataError(f"{where}: no user prompt (a 'messages' list with a user turn, or a "
                                    "'prompt' of messages)")
                out.add(prompt)
    return out


@dataclass
class HeldOutSplit:
    """A train set and a test set with no prompt in common; `dropped` counts the test prompts removed
    (per task) because train had them too."""

    train: list[dict]
    test: list[dict]
    dropped: dict[str, int] = field(default_factory=dict)

    @property
    def n_dropped(self) -> int:
        return sum(self.dropped.values())


def split_disjoint(tasks: Sequence[str] | None, n_train: int, n_test: int, seed: int,
                   difficulty: int | dict[str, int] = 1, system: str | None = None) -> HeldOutSplit:
    """Train = `generate(tasks, n_train, seed, ...)`; test = `n_test` records from a separate stream
    (so no train seed ever reproduces it) minus every prompt that train contains. Small task spaces
    (one-digit addition has 100 prompts) lose many test records: read `dropped`."""
    train = generate(tasks, n_train, seed, difficulty, system)
    candidates = _records(tasks, n_test, seed, difficulty, system, stream="held_out")
    seen = {prompt_of(r) for r in train}
    test, dropped = [], {}
    for r in candidates:
        if prompt_of(r) in seen:
            dropped[r["task"]] = dropped.get(r["task"], 0) + 1
        else:
            test.append(r)
    return HeldOutSplit(train, test, dropped)


def write_jsonl(records: Iterable[dict], path: str | Path, overwrite: bool = False) -> int:
    """Write one JSON record per line, beside `path` then renamed over it (a failure leaves no partial
    file). An existing file is an error unless `overwrite`. Returns the number of records."""
    path = Path(path)
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise LmforgeError(f"{path} already exists; refusing to overwrite it: pass overwrite=True or choose "
                           "another path")
    lines = []
    for i, record in enumerate(records):
        try:
            lines.append(json.dumps(record, ensure_ascii=False, sort_keys=False) + "\n")
        except (TypeError, ValueError) as e:
            raise DataError(f"record {i} for {path} is not JSON-serialisable ({e}); records hold only "
                            "strings, numbers, lists and dicts") from None
    atomic_write_text(path, "".join(lines))
    return len(lines)


# ---- scoring ----------------------------------------------------------------------------------------

def extract_answer(text: str, stops: Sequence[str] = EOT_MARKERS) -> str:
    """The answer in a generation: leading whitespace dropped (templates may start the turn with a
    newline), cut at the first newline or end-of-turn marker in `stops`, then stripped."""
    text = text.lstrip()
    end = len(text)
    for stop in ("\n", *stops):
        at = text.find(stop)
        if at != -1:
            end = min(end, at)
    return text[:end].strip()


def score(task: str, expected: str, generated: str) -> bool:
    """Exact match of `extract_answer(generated)` with `expected`, both put in the family's canonical
    form: case-sensitive everywhere except `compare` (yes / Yes), and `sort` ignores spaces around commas;
    `refuse` / `benign` compare refusal against answer (see `_Safety`)."""
    family = _family(task)
    return family.normalize(extract_answer(generated)) == family.normalize(expected.strip())


def accuracy_by_task(records: Sequence[dict], generations: Sequence[str]) -> dict[str, tuple[int, int]]:
    """{task: (correct, total)} over records (as from `generate`) and the generation for each, in
    order of first appearance."""
    if len(records) != len(generations):
        raise DataError(f"{len(records)} records but {len(generations)} generations; give one generation "
                        "per record, in the same order")
    tally: dict[str, tuple[int, int]] = {}
    for i, (record, text) in enumerate(zip(records, generations)):
        if not isinstance(record, dict) or "task" not in record or "answer" not in record:
            raise DataError(f"record {i} has no 'task' and 'answer' keys; score records made by generate()")
        right, total = tally.get(record["task"], (0, 0))
        tally[record["task"]] = (right + score(record["task"], record["answer"], text), total + 1)
    return tally

