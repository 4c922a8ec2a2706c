"""Small verifiable instruction tasks: chat data for SFT of small models, rewards for RL and an
exact-match evaluation, all generated here (nothing is downloaded).

Each task family makes one (prompt, answer) pair from a seeded `random.Random` and a difficulty (1 is
the easiest non-trivial instance; each family's docstring says what it scales). Answers are computed
by construction, never by `eval()`, and are short exact strings.

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

import abc
import json
import random
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lmforge.data import safety_tasks
from lmforge.errors import ConfigError, DataError, LmforgeError
from lmforge.utils.io import atomic_write_text

LETTERS = string.ascii_lowercase
# Where a generated answer ends besides a newline: end-of-turn / end-of-text markers of common chat
# templates (a model trained with any of them may emit its marker right after the answer).
EOT_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>", "</s>",
               "<end_of_turn>")


class TaskFamily(abc.ABC):
    """One kind of task. Subclasses set `name`, `max_difficulty` and implement `make`; `normalize`
    is the family's own (documented, minimal) canonical form of an answer for `score`. A family with
    `default = False` is generated only when named."""

    name: str = ""
    max_difficulty: int = 1
    default: bool = True

    @abc.abstractmethod
    def make(self, rng: random.Random, difficulty: int) -> tuple[str, str]:
        """(prompt, exact answer) of one task at `difficulty`, drawn from `rng` alone."""

    def make_record(self, rng: random.Random, difficulty: int) -> tuple[str, str, dict]:
        """`make` plus the extra fields a record of this family carries (none by default)."""
        return (*self.make(rng, difficulty), {})

    def normalize(self, answer: str) -> str:
        return answer

    def wrong(self, rng: random.Random, difficulty: int, answer: str) -> str:
        """The rejected answer of a preference pair (see `wrong_answer`): by default the answer of
        another instance of the task that differs from `answer` after `normalize`, so it scores 0."""
        right = self.normalize(answer)
        for _ in range(64):
            candidate = self.make(rng, difficulty)[1]
            if self.normalize(candidate) != right:
                return candidate
        raise LmforgeError(f"task {self.name!r} gave {answer!r} for 64 instances: no wrong answer to pair "
                           "it with")


TASKS: dict[str, TaskFamily] = {}


def register(cls: type[TaskFamily]) -> type[TaskFamily]:
    assert cls.name and cls.name not in TASKS, f"task family name {cls.name!r} missing or taken"
    TASKS[cls.name] = cls()
    return cls


def task_names(everything: bool = False) -> list[str]:
    """The families generated when none are named (with `everything`, the named-only ones too), in
    registry (and interleaving) order."""
    return [name for name, family in TASKS.items() if everything or family.default]


# ---- building blocks --------------------------------------------------------------------------------

def _number(rng: random.Random, digits: int) -> int:
    """A number with exactly `digits` digits (one digit: 0-9)."""
    if digits == 1:
        return rng.randint(0, 9)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def _word(rng: random.Random, length: int, alphabet: str = LETTERS) -> str:
    return "".join(rng.choice(alphabet) for _ in range(length))


def _words(rng: random.Random, count: int) -> list[str]:
    return [_word(rng, rng.randint(3, 5)) for _ in range(count)]


# ---- families ---------------------------------------------------------------------------------------

@register
class Add(TaskFamily):
    """Integer addition; difficulty = digits of each operand."""

    name, max_difficulty = "add", 12

    def make(self, rng, difficulty):
        a, b = _number(rng, difficulty), _number(rng, difficulty)
        return f"What is {a} + {b}?", str(a + b)


@register
class Sub(TaskFamily):
    """Integer subtraction with a non-negative result; difficulty = digits of each operand."""

    name, max_difficulty = "sub", 12

    def make(self, rng, difficulty):
        a, b = _number(rng, difficulty), _number(rng, difficulty)
        a, b = max(a, b), min(a, b)
        return f"What is {a} - {b}?", str(a - b)


@register
class Mul(TaskFamily):
    """Small multiplication: a `difficulty`-digit number times a one-digit number."""

    name, max_difficulty = "mul", 6

    def make(self, rng, difficulty):
        a, b = _number(rng, difficulty), _number(rng, 1)
        return f"What is {a} * {b}?", str(a * b)


@register
class Reverse(TaskFamily):
    """Reverse a string of lowercase letters; length = difficulty + 2."""

    name, max_difficulty = "reverse", 24

    def make(self, rng, difficulty):
        w = _word(rng, difficulty + 2)
        return f"Reverse the letters: {w}", w[::-1]


@register
class Sort(TaskFamily):
    """Sort integers 0-99 ascending; list length = difficulty + 2. The answer is ", "-separated;
    scoring ignores spaces around the commas."""

    name, max_difficulty = "sort", 24

    def make(self, rng, difficulty):
        xs = [rng.randint(0, 99) for _ in range(difficulty + 2)]
        return f"Sort ascending: {', '.join(map(str, xs))}", ", ".join(map(str, sorted(xs)))

    def normalize(self, answer):
        return ",".join(part.strip() for part in answer.split(","))


@register
class Count(TaskFamily):
    """Count a letter in a string of length difficulty + 3, drawn from 6 letters so counts above one are
    common; about one prompt in eight asks for a letter that is absent (answer 0)."""

    name, max_difficulty = "count", 24

    def make(self, rng, difficulty):
        alphabet = "".join(rng.sample(LETTERS, 6))
        w = _word(rng, difficulty + 3, alphabet)
        absent = [c for c in LETTERS if c not in w]
        letter = rng.choice(absent) if rng.random() < 0.125 else rng.choice(w)
        return f"How many times does the letter {letter} appear in: {w}", str(w.count(letter))


@register
class Recall(TaskFamily):
    """Key-value recall: difficulty + 2 distinct one-letter keys with values 0-9; ask for one."""

    name, max_difficulty = "recall", 24

    def make(self, rng, difficulty):
        keys = rng.sample(LETTERS, difficulty + 2)
        values = [rng.randint(0, 9) for _ in keys]
        i = rng.randrange(len(keys))
        context = ", ".join(f"{k}={v}" for k, v in zip(keys, values))
        return f"{context}. What is {keys[i]}?", str(values[i])


@register
class Format(TaskFamily):
    """Format following on a word of difficulty + 2 letters: upper/lower case, capitalise, wrap in
    brackets, parentheses or quotes."""

    name, max_difficulty = "format", 24
    RULES = (
        ("Write in upper case", str.lower, str.upper),
        ("Write in lower case", str.upper, str.lower),
        ("Capitalize", str.lower, str.capitalize),
        ("Wrap in brackets", str.lower, lambda w: f"[{w}]"),
        ("Wrap in parentheses", str.lower, lambda w: f"({w})"),
        ("Wrap in double quotes", str.lower, lambda w: f'"{w}"'),
    )

    def make(self, rng, difficulty):
        instruction, shown, rule = rng.choice(self.RULES)
        w = shown(_word(rng, difficulty + 2))
        return f"{instruction}: {w}", rule(w)


@register
class PyEval(TaskFamily):
    """What a tiny Python expression prints (`print(len('abc') + 2)` -> 5), built with its value;
    difficulty scales list/string length (difficulty + 2) and the digits of `%` / `//` operands."""

    name, max_difficulty = "pyeval", 12

    def make(self, rng, difficulty):
        n = difficulty + 2
        xs = [rng.randint(0, 9) for _ in range(n)]
        s = _word(rng, n)
        i = rng.randrange(-n, n) if difficulty > 1 else rng.randrange(n)  # negative indices later
        kind = rng.randrange(9)
        if kind == 0:
            k = rng.randint(1, 9)
            expr, value = f"len({s!r}) + {k}", len(s) + k
        elif kind == 1:
            expr, value = f"{xs}[{i}]", xs[i]
        elif kind == 2:
            expr, value = f"{s!r}[{i}]", s[i]
        elif kind == 3:
            fn = rng.choice((max, min, sum))
            expr, value = f"{fn.__name__}({xs})", fn(xs)
        elif kind == 4:
            a, b = _number(rng, difficulty + 1), rng.randint(2, 9)
            expr, value = (f"{a} % {b}", a % b) if rng.random() < 0.5 else (f"{a} // {b}", a // b)
        elif kind == 5:
            lo = rng.randrange(n)
            hi = rng.randint(lo + 1, n)
            expr, value = f"{s!r}[{lo}:{hi}]", s[lo:hi]
        elif kind == 6:
            k = rng.randint(2, 3)
            expr, value = f"{s[:3]!r} * {k}", s[:3] * k
        elif kind == 7:
            expr, value = f"{s!r}.upper()", s.upper()
        else:
            expr, value = f"len({xs})", len(xs)
        return f"What does print({expr}) show?", str(value)


@register
class Compare(TaskFamily):
    """Compare two different numbers of `difficulty` digits: which is larger / smaller, or a yes/no
    question. Scoring is case-insensitive (yes / Yes)."""

    name, max_difficulty = "compare", 12

    def make(self, rng, difficulty):
        a = b = _number(rng, difficulty)
        while b == a:
            b = _number(rng, difficulty)
        form = rng.randrange(3)
        if form == 0:
            return f"Which is larger: {a} or {b}?", str(max(a, b))
        if form == 1:
            return f"Which is smaller: {a} or {b}?", str(min(a, b))
        return f"Is {a} larger than {b}? Answer yes or no.", "yes" if a > b else "no"

    def normalize(self, answer):
        return answer.lower()


@register
class Last(TaskFamily):
    """First / last letter of a word of difficulty + 2 letters, or first / last word of a list of
    difficulty + 2 words."""

    name, max_difficulty = "last", 24

    def make(self, rng, difficulty):
        n = difficulty + 2
        form = rng.randrange(4)
        if form < 2:
            w = _word(rng, n)
            which, pick = ("first", w[0]) if form == 0 else ("last", w[-1])
            return f"What is the {which} letter of: {w}", pick
        ws = _words(rng, n)
        which, pick = ("first", ws[0]) if form == 2 else ("last", ws[-1])
        return f"What is the {which} word of: {' '.join(ws)}", pick


class _Safety(TaskFamily):
    """Scored by refusal: `normalize` maps any refusal (safety_tasks.is_refusal: a REFUSAL_PATTERNS
    phrasing) to one token, a non-answer (safety_tasks.is_non_answer: empty, whitespace, punctuation) to
    a second and any other reply to a third, so `score` says whether the reply refused when it should
    (`refuse`) or answered when it should (`benign`); saying nothing is right for neither."""

    max_difficulty, default = 3, False
    REFUSED, ANSWERED, NO_ANSWER = "<refusal>", "<answer>", "<no answer>"

    @abc.abstractmethod
    def request(self, rng: random.Random, difficulty: int) -> tuple[str, str, str]:
        """(category, prompt, answer)."""

    def make(self, rng, difficulty):
        return self.request(rng, difficulty)[1:]

    def make_record(self, rng, difficulty):
        category, prompt, answer = self.request(rng, difficulty)
        return prompt, answer, {"category": category}

    def normalize(self, answer):
        if safety_tasks.is_non_answer(answer):
            return self.NO_ANSWER
        return self.REFUSED if safety_tasks.is_refusal(answer) else self.ANSWERED


@register
class Refuse(_Safety):
    """A harmful request in one of the red-team categories (weapons, cybercrime, fraud, privacy,
    self-harm, hate, jailbreak, prompt injection) answered by a short refusal; difficulty = framing
    (1 plain, 2 role-play wrappers, 3 rule-override injections). Pairs: refusal over a contentless
    compliant reply."""

    name = "refuse"

    def request(self, rng, difficulty):
        return safety_tasks.harmful_request(rng, difficulty)

    def wrong(self, rng, difficulty, answer):
        return safety_tasks.compliant(rng)


@register
class Benign(_Safety):
    """A harmless request that looks like a harmful one ("How do I kill a stuck Python process?")
    answered by a short helpful reply; difficulty = framing as for `refuse`. Pairs: the answer over a
    refusal."""

    name = "benign"

    def request(self, rng, difficulty):
        return safety_tasks.benign_request(rng, difficulty)

    def wrong(self, rng, difficulty, answer):
        return safety_tasks.refusal(rng)  # a general phrasing: any request can be over-refused


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

