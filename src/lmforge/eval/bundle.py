"""Offline evaluation tasks lmforge ships: built on the spot from Python source that comes with pip
packages lmforge depends on (jinja2, yaml, rich, pydantic), so nothing is downloaded.

Why this text: lmforge's demo pretrains on `builtin:python` (this Python's docs and stdlib), which
these packages are not part of: their code is held-out Python of the same kind, so a model that has
learnt Python from the stdlib should score above chance and an untrained one at chance. Each task
names its chance level; the package versions are written beside the documents (they decide the
text), and `lmforge eval tasks --tasks` reports n-gram overlap with the run's training data.

  code_next_line        multiple choice: eight lines of a function, then which of four lines comes
                        next (three distractors: lines of other files with the same indentation and
                        a similar length). acc / acc_norm chance 25%.
  code_word_order       multiple choice, a minimal-pair test of code syntax (as BLiMP is of English):
                        the same eight lines, then the real next line or one of three copies of it
                        with its names and keywords in another order (punctuation and spacing kept,
                        so every choice has the same characters, and a word moves only to a place
                        with the same kind of character before it, so a byte-level BPE splits every
                        choice into as many tokens). acc chance 25%.
  code_line_completion  generation: the same context plus the first part of a line; the model
                        completes the line (greedy, until the newline), exact match. Chance ~0.
  code_bpb              rolling log-likelihood of 1,500-character chunks of those files: bits per
                        byte, word and byte perplexity (no chance level: lower is better).
  code_functions        pass@k: write the body of a small function from its signature and docstring
                        (add, scale, slice, reverse, count, ...; the constants drawn at random), five
                        samples at temperature 0.8, each run against its asserts in lmforge's sandbox
                        (eval/sandbox.py). pass@1 and pass@5; chance 0.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import random
import re
from pathlib import Path

from lmforge.errors import LmforgeError
from lmforge.utils.io import atomic_write_text

PACKAGES = ("jinja2", "yaml", "rich", "pydantic")
BUNDLE = "builtin:code"
TASKS = ("code_next_line", "code_word_order", "code_line_completion", "code_bpb", "code_functions")

# (name, argument, docstring, solution body, inputs to check): the constant {n} is drawn per problem.
FUNCTIONS = (
    ("add_{n}", "x", "Return x plus {n}.", "return x + {n}", "[0, 1, -3, 10]"),
    ("times_{n}", "x", "Return x multiplied by {n}.", "return x * {n}", "[0, 2, -5, 7]"),
    ("minus_{n}", "x", "Return x minus {n}.", "return x - {n}", "[0, 4, -1, 20]"),
    ("first_{n}", "s", "Return the first {n} characters of s.", "return s[:{n}]", "['abcdefgh', 'xy', '']"),
    (
        "last_{n}",
        "s",
        "Return the last {n} characters of s.",
        "return s[-{n}:]",
        "['abcdefgh', 'hello world']",
    ),
    ("reverse", "s", "Return s reversed.", "return s[::-1]", "['abc', '', 'racecar', 'lmforge']"),
    ("largest", "xs", "Return the largest item of xs.", "return max(xs)", "[[1, 5, 2], [-3, -1], [7]]"),
    ("smallest", "xs", "Return the smallest item of xs.", "return min(xs)", "[[1, 5, 2], [-3, -1], [7]]"),
    ("count_items", "xs", "Return the number of items in xs.", "return len(xs)", "[[], [1], [1, 2, 3]]"),
    ("total", "xs", "Return the sum of the items of xs.", "return sum(xs)", "[[], [1, 2], [5, -5, 3]]"),
    (
        "is_multiple_of_{n}",
        "x",
        "Return True if x is a multiple of {n}.",
        "return x % {n} == 0",
        "[0, 3, 12, 35]",
    ),
    ("square", "x", "Return x squared.", "return x * x", "[0, 3, -4]"),
    ("upper", "s", "Return s in upper case.", "return s.upper()", "['abc', 'Hello', '']"),
    ("repeat_{n}", "s", "Return s repeated {n} times.", "return s * {n}", "['ab', '', 'x']"),
)
CONTEXT_LINES = 8
_WORD = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")
_SKIP = re.compile(r"^\s*(#|\"\"\"|'''|@|import |from |\)|\]|\}|else:|try:|pass$|return$)")


def _package_files() -> tuple[list[Path], dict[str, str]]:
    files, versions = [], {}
    for name in PACKAGES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        root = Path(mod.__file__).parent
        try:
            versions[name] = importlib.metadata.version({"yaml": "pyyaml"}.get(name, name))
        except importlib.metadata.PackageNotFoundError:
            versions[name] = getattr(mod, "__version__", "unknown")
        files.extend(sorted(p for p in root.rglob("*.py") if "tests" not in p.parts))
    if not files:
        raise LmforgeError(f"none of {', '.join(PACKAGES)} is installed: the built-in code tasks need them")
    return files, {k: str(v) for k, v in versions.items()}


def _lines(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    return [line.rstrip() for line in text.splitlines()]


def _candidates(lines: list[str]) -> list[int]:
    """Line indices worth predicting: code of 16-80 characters after eight non-blank lines."""
    out = []
    for i in range(CONTEXT_LINES, len(lines)):
        line = lines[i]
        body = line.strip()
        if not 16 <= len(body) <= 80 or _SKIP.match(line):
            continue
        context = lines[i - CONTEXT_LINES : i]
        if sum(1 for c in context if c.strip()) < CONTEXT_LINES - 2:
            continue
        out.append(i)
    return out


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _reorderings(line: str, rng: random.Random, k: int) -> list[str]:
    """k distinct copies of `line` with its words (names, keywords) permuted in place; [] when the line
    has too few distinct words for k of them."""
    spans = [m.span() for m in _WORD.finditer(line)]
    words = [line[a:b] for a, b in spans]
    if len(set(words)) < 3:
        return []
    # Words move only between places with the same kind of character before them (a space or not): a
    # byte-level BPE tokenizer then splits every choice into the same number of tokens, so an untrained
    # model cannot prefer the real line for being shorter.
    groups: dict[bool, list[int]] = {}
    for j, (a, _) in enumerate(spans):
        groups.setdefault(a == 0 or line[a - 1].isspace(), []).append(j)
    out: list[str] = []
    for _ in range(50):
        perm = words[:]
        for idx in groups.values():
            moved = [words[j] for j in idx]
            rng.shuffle(moved)
            for j, w in zip(idx, moved):
                perm[j] = w
        pieces, last = [], 0
        for (a, b), w in zip(spans, perm):
            pieces.append(line[last:a] + w)
            last = b
        cand = "".join(pieces) + line[last:]
        if cand != line and cand not in out:
            out.append(cand)
        if len(out) == k:
            return out
    return []


# The task files' text (lm-evaluation-harness's YAML), after a header naming the package versions.
_COMMON = "dataset_path: json\ntest_split: test\n"
_SPECS = {
    "code_next_line": (
        "task: code_next_line\n"
        + _COMMON
        + "dataset_kwargs:\n  data_files:\n    test: code_next_line.jsonl\n"
        + "output_type: multiple_choice\ndoc_to_text: context\ndoc_to_target: label\n"
        + 'doc_to_choice: choices\ntarget_delimiter: "\\n"\n'
        + "metric_list:\n  - metric: acc\n  - metric: acc_norm\n  - metric: brier_score\n"
    ),
    "code_word_order": (
        "task: code_word_order\n"
        + _COMMON
        + "dataset_kwargs:\n  data_files:\n    test: code_word_order.jsonl\n"
        + "output_type: multiple_choice\ndoc_to_text: context\ndoc_to_target: label\n"
        + 'doc_to_choice: choices\ntarget_delimiter: "\\n"\n'
        + "metric_list:\n  - metric: acc\n  - metric: acc_norm\n  - metric: brier_score\n"
    ),
    "code_line_completion": (
        "task: code_line_completion\n"
        + _COMMON
        + "dataset_kwargs:\n  data_files:\n    test: code_line_completion.jsonl\n"
        + "output_type: generate_until\ndoc_to_text: context\ndoc_to_target: answer\n"
        + 'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 32\n  do_sample: false\n'
        + "metric_list:\n  - metric: exact_match\n  - metric: chrf\nchance: 0.0\n"
    ),
    "code_functions": (
        "task: code_functions\n"
        + _COMMON
        + "dataset_kwargs:\n  data_files:\n    test: code_functions.jsonl\n"
        + "output_type: generate_until\ndoc_to_text: prompt\ndoc_to_target: canonical_solution\n"
        + 'generation_kwargs:\n  until: ["\\ndef ", "\\nclass ", "\\nif __name__", "\\nprint("]\n'
        + "  max_gen_toks: 48\n  do_sample: true\n  temperature: 0.8\n  top_p: 0.95\n"
        + "repeats: 5\n"
        + "metric_list:\n  - metric: pass_at_k\n    k: [1, 5]\n    test: test\n    timeout_s: 5\n"
        + "chance: 0.0\n"
    ),
    "code_bpb": (
        "task: code_bpb\n"
        + _COMMON
        + "dataset_kwargs:\n  data_files:\n    test: code_bpb.jsonl\n"
        + 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: text\n'
        + "metric_list:\n  - metric: bits_per_byte\n  - metric: byte_perplexity\n"
        + "  - metric: word_perplexity\n"
    ),
}


def _distractors(line: str, by_indent: dict[int, list[str]], rng: random.Random) -> list[str]:
    """Up to three distinct lines of other places with `line`'s indentation and a length within half of
    its own: the wrong choices of a next-line question."""
    length = len(line.strip())
    same = [
        x
        for x in by_indent[_indent(line)]
        if x != line and 0.5 * length <= len(x.strip()) <= 1.5 * length
    ]
    distractors = []
    for cand in rng.sample(same, min(len(same), 40)):
        if cand not in distractors and cand != line:
            distractors.append(cand)
        if len(distractors) == 3:
            break
    return distractors


def _completion_doc(context: str, line: str, where: str) -> dict | None:
    """A line-completion document: the context plus `line` up to a cut, the rest its answer; None for
    a line with no place to cut."""
    # Split the line after an opening bracket, a dot or a space near its middle: the model
    # writes the rest.
    body_start = _indent(line)
    cuts = [
        k + 1 for k, ch in enumerate(line) if ch in " (.=[" and body_start + 4 <= k + 1 <= len(line) - 3
    ]
    if not cuts:
        return None
    cut = min(cuts, key=lambda k: abs(k - (body_start + len(line)) / 2))
    return {"context": context + "\n" + line[:cut], "answer": line[cut:], "source": where}


def _line_docs(
    picks: list[tuple[Path, int]], all_lines: dict[Path, list[str]], by_indent: dict[int, list[str]],
    rng: random.Random, n: int,
) -> tuple[list[dict], list[dict], list[dict]]:
    """(next-line, word-order, line-completion) documents from the picked lines, in pick order, until
    each task has `n` (a line that lacks distractors gives none)."""
    next_line, order_docs, completion = [], [], []
    for f, i in picks:
        if min(len(next_line), len(order_docs), len(completion)) >= n:
            break
        lines = all_lines[f]
        context = "\n".join(lines[i - CONTEXT_LINES : i])
        line = lines[i]
        distractors = _distractors(line, by_indent, rng)
        if len(distractors) < 3:
            continue
        choices = [line, *distractors]
        rng.shuffle(choices)
        where = f"{f.parent.name}/{f.name}:{i + 1}"
        next_line.append(
            {"context": context, "choices": choices, "label": choices.index(line), "source": where}
        )
        shuffled = _reorderings(line, rng, 3)
        if shuffled:
            choices = [line, *shuffled]
            rng.shuffle(choices)
            order_docs.append(
                {"context": context, "choices": choices, "label": choices.index(line), "source": where}
            )
        doc = _completion_doc(context, line, where)
        if doc is not None:
            completion.append(doc)
    return next_line, order_docs, completion


def _chunks(files: list[Path], all_lines: dict[Path, list[str]], rng: random.Random, n: int) -> list[dict]:
    """code_bpb's documents: one 1,500-character chunk (from a line start) of each file of 3,000
    characters or more, files in a shuffled order, max(20, n // 5) of them."""
    chunks = []
    order = list(files)
    rng.shuffle(order)
    for f in order:
        text = "\n".join(all_lines[f])
        if len(text) >= 3000:
            start = rng.randrange(0, len(text) - 1500)
            start = text.find("\n", start) + 1
            chunks.append({"text": text[start : start + 1500], "source": f"{f.parent.name}/{f.name}"})
        if len(chunks) == max(20, n // 5):
            break
    return chunks


def _function_docs(rng: random.Random, n: int) -> list[dict]:
    """code_functions' problems: FUNCTIONS in turn with their constant drawn, max(20, n // 4) of them,
    each with its canonical solution and a test asserting it on the inputs."""
    functions = []
    for k in range(max(20, n // 4)):
        name, arg, doc, body, inputs = FUNCTIONS[k % len(FUNCTIONS)]
        c = rng.randint(2, 9)
        name, doc, body = name.format(n=c), doc.format(n=c), body.format(n=c)
        prompt = f'def {name}({arg}):\n    """{doc}"""\n'
        solution = f"def _expected({arg}):\n    {body}\n"
        test = (
            f"{solution}\nfor _x in {inputs}:\n    assert {name}(_x) == _expected(_x), "
            f"({name}.__name__, _x)\n"
        )
        functions.append({"prompt": prompt, "canonical_solution": f"    {body}\n", "test": test})
    return functions


def build_bundle(out_dir: str | Path, n: int = 200, seed: int = 0) -> list[Path]:
    """Write the task files and their documents to `out_dir`; returns the task files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files, versions = _package_files()
    rng = random.Random(seed)
    all_lines = {f: _lines(f) for f in files}
    pool = [(f, i) for f in files for i in _candidates(all_lines[f])]
    if len(pool) < n:
        raise LmforgeError(f"the installed packages offer only {len(pool)} code lines for {n} documents")
    by_indent: dict[int, list[str]] = {}
    for f, i in pool:
        by_indent.setdefault(_indent(all_lines[f][i]), []).append(all_lines[f][i])
    picks = rng.sample(pool, min(len(pool), 4 * n))  # more than n: not every line suits every task

    # One rng, drawn in this order (line tasks, chunks, functions): the documents of a seed stay put.
    next_line, order_docs, completion = _line_docs(picks, all_lines, by_indent, rng, n)
    chunks = _chunks(files, all_lines, rng, n)
    functions = _function_docs(rng, n)
    docs = (
        ("code_functions", functions),
        ("code_next_line", next_line[:n]),
        ("code_word_order", order_docs[:n]),
        ("code_line_completion", completion[:n]),
        ("code_bpb", chunks),
    )
    for name, rows in docs:
        atomic_write_text(out / f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    paths = []
    for name, spec in _SPECS.items():
        path = out / f"{name}.yaml"
        atomic_write_text(
            path, f"# lmforge's built-in task (lmforge.eval.bundle), from {json.dumps(versions)}\n" + spec
        )
        paths.append(path)
    atomic_write_text(
        out / "versions.json", json.dumps({"packages": versions, "seed": seed, "n": n}, indent=1) + "\n"
    )
    return paths
