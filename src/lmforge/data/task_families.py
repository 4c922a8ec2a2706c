"""The instruction task families: one small class per kind of verifiable task, each making a (prompt,
exact answer) pair from a seeded `random.Random` and a difficulty, and owning its canonical answer form
(`normalize`) and its wrong answers (`wrong`). `register` puts a family in `TASKS`, the registry that
data/instruct_tasks.py generates records from and scores against.

A new task family is one class here with `@register` (and its tests in tests/unit/test_instruct_tasks.py).
The safety families (`refuse`, `benign`) draw their requests and replies from data/safety_tasks.py.
"""

from __future__ import annotations

import abc
import random
import string

from lmforge.data import safety_tasks
from lmforge.errors import LmforgeError

LETTERS = string.ascii_lowercase


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
