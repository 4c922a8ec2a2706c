"""Instruction tasks: every answer is recomputed here from the prompt alone (parsing it, never trusting
the generator), generation is deterministic and balanced, held-out sets share no prompt with train,
files are written atomically, and scoring follows its documented rules."""

from __future__ import annotations

import ast
import json
import os
import re

import pytest

from lmforge.data import instruct_tasks as it
from lmforge.errors import ConfigError, DataError, LmforgeError

FAMILIES = ["add", "sub", "mul", "reverse", "sort", "count", "recall", "format", "pyeval", "compare", "last"]


# ---- an independent solver: the prompt text in, the right answer out ---------------------------------

def _safe_eval(node: ast.AST):
    """A whitelist evaluator for the tiny expressions of `pyeval` (no eval(): the test must not trust
    the strings either)."""
    if isinstance(node, ast.Expression):
        return _safe_eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, str)):
        return node.value
    if isinstance(node, ast.List):
        return [_safe_eval(e) for e in node.elts]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_safe_eval(node.operand)
    if isinstance(node, ast.BinOp):
        ops = {ast.Add: lambda a, b: a + b, ast.Mod: lambda a, b: a % b,
               ast.FloorDiv: lambda a, b: a // b, ast.Mult: lambda a, b: a * b}
        return ops[type(node.op)](_safe_eval(node.left), _safe_eval(node.right))
    if isinstance(node, ast.Subscript):
        seq = _safe_eval(node.value)
        if isinstance(node.slice, ast.Slice):
            return seq[_safe_eval(node.slice.lower):_safe_eval(node.slice.upper)]
        return seq[_safe_eval(node.slice)]
    if isinstance(node, ast.Call) and not node.keywords and len(node.args) <= 1:
        if isinstance(node.func, ast.Name):
            return {"len": len, "max": max, "min": min, "sum": sum}[node.func.id](_safe_eval(node.args[0]))
        if isinstance(node.func, ast.Attribute) and node.func.attr == "upper" and not node.args:
            return _safe_eval(node.func.value).upper()
    raise AssertionError(f"unexpected expression node {ast.dump(node)}")


def solve(task: str, prompt: str) -> str:
    if task in ("add", "sub", "mul"):
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", prompt).groups()
        assert op == {"add": "+", "sub": "-", "mul": "*"}[task]
        return str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])
    if task == "reverse":
        return "".join(reversed(re.fullmatch(r"Reverse the letters: ([a-z]+)", prompt).group(1)))
    if task == "sort":
        xs = re.fullmatch(r"Sort ascending: ([\d, ]+)", prompt).group(1).split(", ")
        return ", ".join(str(x) for x in sorted(int(x) for x in xs))
    if task == "count":
        m = re.fullmatch(r"How many times does the letter ([a-z]) appear in: ([a-z]+)", prompt)
        letter, word = m.groups()
        return str(sum(c == letter for c in word))
    if task == "recall":
        context, key = re.fullmatch(r"(.+)\. What is ([a-z])\?", prompt).groups()
        table = dict(pair.split("=") for pair in context.split(", "))
        assert len(table) == len(context.split(", ")), "keys must be distinct"
        return table[key]
    if task == "format":
        rule, word = prompt.split(": ")
        return {"Write in upper case": word.upper(), "Write in lower case": word.lower(),
                "Capitalize": word[:1].upper() + word[1:].lower(), "Wrap in brackets": "[" + word + "]",
                "Wrap in parentheses": "(" + word + ")", "Wrap in double quotes": '"' + word + '"'}[rule]
    if task == "pyeval":
        expr = re.fullmatch(r"What does print\((.+)\) show\?", prompt).group(1)
        return str(_safe_eval(ast.parse(expr, mode="eval")))
    if task == "compare":
        m = re.fullmatch(r"Which is (larger|smaller): (\d+) or (\d+)\?", prompt)
        if m:
            a, b = int(m.group(2)), int(m.group(3))
            assert a != b
            return str(max(a, b) if m.group(1) == "larger" else min(a, b))
        a, b = map(int, re.fullmatch(r"Is (\d+) larger than (\d+)\? Answer yes or no\.", prompt).groups())
        assert a != b
        return "yes" if a > b else "no"
    if task == "last":
        which, unit, data = re.fullmatch(r"What is the (first|last) (letter|word) of: (.+)", prompt).groups()
        items = list(data) if unit == "letter" else data.split(" ")
        return items[0] if which == "first" else items[-1]
    raise AssertionError(task)


# ---- answers -----------------------------------------------------------------------------------------

def test_registry_has_every_family_with_docs():
    assert it.task_names() == FAMILIES
    for name, family in it.TASKS.items():
        assert family.name == name and family.__doc__ and family.max_difficulty >= 3


@pytest.mark.parametrize("difficulty", [1, 2, 3, "max"])
def test_answers_are_right_for_many_seeds(difficulty):
    levels = {t: it.TASKS[t].max_difficulty for t in FAMILIES} if difficulty == "max" else difficulty
    for seed in range(12):
        for r in it.generate(None, 11 * 20, seed, difficulty=levels):
            prompt, answer = it.prompt_of(r), r["answer"]
            assert solve(r["task"], prompt) == answer, (r["task"], prompt, answer)
            assert r["messages"][-1] == {"role": "assistant", "content": answer}
            assert answer and "\n" not in answer and answer == answer.strip()
            assert len(prompt) < 200  # small models, short sequences


def test_families_cover_their_variants():
    """Each family's forms all occur (a generator stuck on one branch would still give right answers)."""
    prompts = [it.prompt_of(r) for r in it.generate(None, 11 * 300, 0, difficulty=2)]
    for pattern in ["Write in upper case", "Write in lower case", "Capitalize", "brackets", "parentheses",
                    "quotes", "Which is larger", "Which is smaller", "Answer yes or no", "first letter",
                    "last letter", "first word", "last word", r"len\('", r"len\(\[", r"max\(", r"min\(",
                    r"sum\(", " % ", " // ", r"\.upper\(\)", r"\]\[-?\d\]\)", r"'\[-?\d\]\)",
                    r"'\[\d:\d\]\)", "' \\* "]:
        assert any(re.search(pattern, p) for p in prompts), pattern
    counts = [r["answer"] for r in it.generate(["count"], 400, 0)]
    assert "0" in counts and any(int(c) > 1 for c in counts)
    yes_no = {r["answer"] for r in it.generate(["compare"], 100, 0)} & {"yes", "no"}
    assert yes_no == {"yes", "no"}


# ---- determinism and balance -------------------------------------------------------------------------

def test_same_seed_same_records_other_seed_other_records():
    a = it.generate(None, 50, 3, difficulty=2)
    assert a == it.generate(None, 50, 3, difficulty=2)
    assert json.dumps(a) == json.dumps(it.generate(None, 50, 3, difficulty=2))
    assert [it.prompt_of(r) for r in a] != [it.prompt_of(r) for r in it.generate(None, 50, 4, difficulty=2)]
    assert it.generate(None, 20, 3, difficulty=2) == a[:20]  # record i does not depend on n


def test_golden_records():
    """Pinned output: seeding by strings (SHA-512) gives these on every machine and Python >= 3.10; a change
    here means every previously generated data set and held-out split changed."""
    got = [(r["task"], it.prompt_of(r), r["answer"]) for r in it.generate(None, 11, 0, difficulty=2)]
    assert got[:4] == [("add", "What is 48 + 32?", "80"), ("sub", "What is 39 - 12?", "27"),
                       ("mul", "What is 26 * 5?", "130"), ("reverse", "Reverse the letters: cqzx", "xzqc")]
    assert got[8] == ("pyeval", "What does print([8, 1, 6, 4][-2]) show?", "6")


def test_every_family_appears_evenly():
    records = it.generate(None, len(FAMILIES), 0)
    assert [r["task"] for r in records] == FAMILIES
    tasks = [r["task"] for r in it.generate(["add", "reverse", "recall"], 31, 0)]
    assert tasks[:6] == ["add", "reverse", "recall"] * 2
    assert sorted(tasks.count(t) for t in ("add", "reverse", "recall")) == [10, 10, 11]
    assert {r["task"] for r in it.generate("sort, count", 4, 0)} == {"sort", "count"}


def test_difficulty_scales_size():
    def sizes(task, level):
        return [len(it.prompt_of(r)) for r in it.generate([task], 40, 1, difficulty=level)]

    for task in FAMILIES:
        assert sum(sizes(task, 4)) > sum(sizes(task, 1)), task
    adds = it.generate(["add"], 30, 0, difficulty=5)
    assert all(len(n) == 5 for r in adds for n in re.findall(r"\d+", it.prompt_of(r)))
    assert {len(r["answer"]) for r in it.generate(["reverse"], 10, 0, difficulty=6)} == {8}
    assert {r["answer"].count(",") for r in it.generate(["sort"], 10, 0, difficulty=3)} == {4}
    mixed = it.generate(["add", "reverse"], 10, 0, difficulty={"reverse": 4})
    assert {(r["task"], r["difficulty"]) for r in mixed} == {("add", 1), ("reverse", 4)}


def test_system_message_is_optional():
    with_sys = it.generate(["add"], 2, 0, system="Answer with the result only.")
    assert [m["role"] for m in with_sys[0]["messages"]] == ["system", "user", "assistant"]
    assert with_sys[0]["messages"][0]["content"] == "Answer with the result only."
    assert [m["role"] for m in it.generate(["add"], 1, 0)[0]["messages"]] == ["user", "assistant"]


def test_user_errors_name_the_choices():
    with pytest.raises(ConfigError, match=r"unknown instruction task 'addition'.*add, sub, mul"):
        it.generate(["add", "addition"], 4, 0)
    with pytest.raises(ConfigError, match="unknown instruction task 'nope'"):
        it.generate(None, 4, 0, difficulty={"nope": 2})
    with pytest.raises(ConfigError, match=r"difficulty for task 'mul' is 7; give an integer from 1 to 6"):
        it.generate(["mul"], 4, 0, difficulty=7)
    with pytest.raises(ConfigError, match="difficulty"):
        it.generate(["add"], 4, 0, difficulty=0)
    with pytest.raises(ConfigError, match="no instruction tasks"):
        it.generate([], 4, 0)
    with pytest.raises(ConfigError, match="n=-1"):
        it.generate(None, -1, 0)
    with pytest.raises(ConfigError, match="unknown instruction task"):
        it.score("nope", "1", "1")


# ---- held-out split ----------------------------------------------------------------------------------

def test_held_out_split_shares_no_prompt():
    split = it.split_disjoint(None, 400, 200, seed=5, difficulty=1)
    train = {it.prompt_of(r) for r in split.train}
    assert len(split.train) == 400
    assert not train & {it.prompt_of(r) for r in split.test}
    assert len(split.test) + split.n_dropped == 200
    assert split.n_dropped > 0 and set(split.dropped) <= set(FAMILIES)  # 1-digit add: only 100 prompts
    assert split.train == it.generate(None, 400, 5, difficulty=1)
    # the test stream is its own: no train seed reproduces it
    other_seed = [it.prompt_of(r) for r in it.generate(None, 20, 6)]
    assert [it.prompt_of(r) for r in split.test[:20]] != other_seed
    big = it.split_disjoint(["reverse"], 100, 50, seed=0, difficulty=8)
    assert big.n_dropped == 0 and len(big.test) == 50


# ---- writing -----------------------------------------------------------------------------------------

def test_write_jsonl_round_trip_and_refuses_to_clobber(tmp_path):
    records = it.generate(None, 11, 0, system="Be brief.")
    path = tmp_path / "sft.jsonl"
    assert it.write_jsonl(records, path) == 11
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == records
    with pytest.raises(LmforgeError, match=r"sft\.jsonl already exists.*overwrite=True"):
        it.write_jsonl(records[:1], path)
    assert len(path.read_text().splitlines()) == 11  # untouched
    it.write_jsonl(records[:2], path, overwrite=True)
    assert len(path.read_text().splitlines()) == 2


def test_write_jsonl_leaves_no_partial_file(tmp_path, monkeypatch):
    bad = it.generate(None, 3, 0) + [{"task": "add", "answer": object()}]
    with pytest.raises(DataError, match="record 3"):
        it.write_jsonl(bad, tmp_path / "out.jsonl")
    assert os.listdir(tmp_path) == []

    path = tmp_path / "keep.jsonl"
    it.write_jsonl(it.generate(None, 2, 0), path)
    before = path.read_bytes()

    def failing_replace(src, dst):
        raise OSError("simulated crash at rename")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="simulated"):
        it.write_jsonl(it.generate(None, 5, 1), path, overwrite=True)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["keep.jsonl"]


# ---- scoring -----------------------------------------------------------------------------------------

def test_extract_answer_rules():
    assert it.extract_answer("  42  ") == "42"
    assert it.extract_answer("42\nbecause 40 + 2") == "42"
    assert it.extract_answer("\n 42<|im_end|>junk") == "42"  # a leading newline from the template is dropped
    assert it.extract_answer("abc</s>") == "abc"
    assert it.extract_answer("7<|eot_id|>\n8") == "7"
    assert it.extract_answer("") == ""
    assert it.extract_answer("x;y", stops=(";",)) == "x"


def test_score_rules():
    assert it.score("add", "80", " 80\n")
    assert it.score("add", "80", "80<|endoftext|>")
    assert not it.score("add", "80", "The answer is 80")  # no hunting for numbers: exact match
    assert not it.score("add", "80", "800")
    assert not it.score("reverse", "xzqc", "XZQC")  # case-sensitive by default
    assert not it.score("format", "QEGB", "qegb")
    assert it.score("compare", "yes", "Yes")  # compare documents case-insensitivity
    assert it.score("sort", "1, 5, 9", "1,5,9") and it.score("sort", "1, 5, 9", "1 , 5,  9")
    assert not it.score("sort", "1, 5, 9", "1, 9, 5")


def test_generated_answers_score_as_correct_and_accuracy_by_task():
    records = it.generate(None, 44, 2, difficulty=2)
    assert all(it.score(r["task"], r["answer"], r["answer"] + "\n") for r in records)
    generations = [r["answer"] if i % 4 else "wrong" for i, r in enumerate(records)]
    acc = it.accuracy_by_task(records, generations)
    assert list(acc) == FAMILIES
    assert sum(c for c, _ in acc.values()) == 33 and all(t == 4 for _, t in acc.values())
    with pytest.raises(DataError, match="44 records but 3 generations"):
        it.accuracy_by_task(records, generations[:3])
    with pytest.raises(DataError, match="record 0"):
        it.accuracy_by_task([{"messages": []}], ["1"])


def test_prompt_disjoint_sets_of_a_small_task_space(tmp_path):
    """--unique / --exclude-prompts: held-out, RL and SFT files of one-digit arithmetic (255 prompts)
    share no prompt; the unique files hold each prompt once; the stream is the same as generate's."""
    from lmforge.cli import main

    paths = {k: tmp_path / f"{k}.jsonl" for k in ("test", "rl", "sft")}
    common = ["tasks", "--tasks", "add,sub,mul", "--difficulty", "1"]
    assert main([*common, "-o", str(paths["test"]), "--n", "64", "--unique", "--seed", "1"]) == 0
    assert main([*common, "-o", str(paths["rl"]), "--n", "64", "--unique", "--seed", "2",
                 "--exclude-prompts", str(paths["test"])]) == 0
    assert main([*common, "-o", str(paths["sft"]), "--n", "500", "--seed", "3",
                 "--exclude-prompts", str(paths["test"]), "--exclude-prompts", str(paths["rl"])]) == 0
    rows = {k: [json.loads(line) for line in p.read_text().splitlines()] for k, p in paths.items()}
    prompts = {k: [it.prompt_of(r) for r in v] for k, v in rows.items()}
    assert len(rows["test"]) == len(set(prompts["test"])) == 64 == len(set(prompts["rl"]))
    assert len(rows["sft"]) == 500 and 100 < len(set(prompts["sft"])) <= 255 - 128
    assert not set(prompts["test"]) & set(prompts["rl"])
    assert not set(prompts["sft"]) & set(prompts["test"] + prompts["rl"])
    # without exclusions the selection is generate's stream itself
    assert it.select(["add"], 7, 5) == it.generate(["add"], 7, 5)
    # a space smaller than n: every prompt once, then stop
    assert len(it.select(["add"], 300, 0, unique=True)) == 100


def test_excluded_prompts_file_is_checked(tmp_path):
    from lmforge.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "What is 1 + 2?"}]}\n{"x": 1}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: no user prompt"):
        it.prompts_in([bad])
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "What is 1 + 2?", "answer": "3"}\n')
    assert it.prompts_in([plain]) == {"What is 1 + 2?"}
    out = str(tmp_path / "o.jsonl")
    assert main(["tasks", "-o", out, "--exclude-prompts", str(tmp_path / "no.jsonl")]) == 2
    assert main(["tasks", "-o", out, "--unique", "--test-out", str(tmp_path / "t.jsonl")]) == 2
    assert not (tmp_path / "o.jsonl").exists()
