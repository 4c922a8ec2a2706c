"""The shipped question-answering set: short Python-like modules with questions whose answer is a span of
the module (`lmforge tasks --qa`), SQuAD's shape, for the extractive-QA demo and tests, offline and
deterministic like the other shipped tasks.

    context:  "import json\\nimport re\\n\\nlimit = 42\\n\\ndef load_items(path):\\n    return
               json.loads(path)\\n..." (one string)
    question: "What does load_items return?"
    answers:  {"text": ["json.loads(path)"], "answer_start": [68]}

Questions ask which module is imported first or second, what a function returns, what argument it takes
and what number a variable is set to; the answer occurs once where the question points (answer_start is
its character offset). The same seed writes the same records; a validation record's context never
occurs in training.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

_MODULES = ("os", "re", "json", "math", "time", "random", "string", "shutil", "pathlib", "csv", "heapq",
            "bisect", "struct", "zlib", "gzip", "hashlib", "textwrap", "itertools")
_FUNCS = ("load_items", "parse_line", "count_words", "read_table", "merge_rows", "clean_text", "split_path",
          "score_item", "render_page", "fetch_value", "check_name", "build_index")
_ARGS = ("path", "text", "items", "line", "rows", "name", "value", "data", "key", "words")
_VARS = ("limit", "size", "retries", "width", "depth", "timeout", "offset", "batch")
_CALLS = ("loads", "dumps", "split", "join", "sub", "sqrt", "floor", "sleep", "choice", "copy", "digest")


def _expr(rng: random.Random, module: str, arg: str, var: str) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return f"{module}.{rng.choice(_CALLS)}({arg})"
    if kind == 1:
        return f"{arg} * {var}"
    if kind == 2:
        return f"len({arg}) + {rng.randrange(1, 10)}"
    return f"[{arg}, {var}]"


def module(rng: random.Random) -> list[dict]:
    """One module and a record for each question about it."""
    m1, m2 = rng.sample(_MODULES, 2)
    f1, f2 = rng.sample(_FUNCS, 2)
    a1, a2 = rng.sample(_ARGS, 2)
    var, num = rng.choice(_VARS), str(rng.randrange(2, 1000))
    e1, e2 = _expr(rng, m1, a1, var), _expr(rng, m2, a2, var)
    lines = [f"import {m1}", f"import {m2}", "", f"{var} = {num}", "", f"def {f1}({a1}):",
             f"    return {e1}", "", f"def {f2}({a2}):", f"    return {e2}", ""]
    context = "\n".join(lines)
    at = lambda line, text: context.index(line) + line.index(text)  # noqa: E731 - lines are distinct
    asked = [
        ("Which module is imported first?", m1, at(f"import {m1}\n", m1)),
        ("Which module is imported second?", m2, at(f"\nimport {m2}\n", m2)),
        (f"What is {var} set to?", num, at(f"{var} = {num}", num)),
        (f"What does {f1} return?", e1, at(f"def {f1}({a1}):\n    return {e1}", e1)),
        (f"What does {f2} return?", e2, at(f"def {f2}({a2}):\n    return {e2}", e2)),
        (f"What argument does {f1} take?", a1, at(f"def {f1}({a1})", f"({a1})") + 1),
    ]
    return [{"context": context, "question": q, "answers": {"text": [a], "answer_start": [s]}}
            for q, a, s in asked]


def qa_split(n_train: int, n_val: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, validation) records, two questions of each module drawn: validation first from the seeded
    stream, training records skip any context validation has."""
    stream = _stream(seed)
    val, seen = [], set()
    while len(val) < n_val:
        r = next(stream)
        seen.add(r["context"])
        val.append(r)
    train = []
    for _ in range(50 * max(n_train, 1)):
        if len(train) >= n_train:
            break
        r = next(stream)
        if r["context"] not in seen:
            train.append(r)
    return train, val


def _stream(seed: int) -> Iterator[dict]:
    rng = random.Random(f"lmforge-qa:{seed}")
    while True:
        yield from rng.sample(module(rng), 2)
