"""Every regex that comes from a file (task filters, `regex_replace` in task templates, exact_match's
regexes_to_ignore, PEFT's target_modules) runs under a time budget: catastrophic backtracking is a clear
error naming the pattern and where it came from, in seconds, not a hang."""

from __future__ import annotations

import re
import time

import pytest

from lmforge.errors import LmforgeError
from lmforge.eval import metrics as M
from lmforge.eval.tasks import TaskError, apply_filter, load_task, render
from lmforge.finetune.peft_io import _peft_matches
from lmforge.utils.safe_regex import TIMEOUT_S, compile_regex

EVIL = r"(x+x+)+y"  # exponential in the length of a run of x's under a backtracking engine
TEXT = "x" * 5000


def _refused_within_budget(fn, match: str) -> None:
    """`fn` raises `match` having done at most the budget's work. The budget is CPU time (the `regex`
    package's timeout counts it), so the work is counted as this thread's CPU time, not the wall clock: on
    a loaded machine 1 s of CPU took 8 s of wall clock, which a wall-clock bound mistook for a hang."""
    t0 = time.thread_time()
    with pytest.raises(LmforgeError, match=match):
        fn()
    assert time.thread_time() - t0 < TIMEOUT_S + 1  # the budget, and room for the rest of the call


def test_a_catastrophic_pattern_stops_at_its_budget_and_names_itself():
    pattern = compile_regex(EVIL, "t.yaml: filter f")
    _refused_within_budget(lambda: pattern.findall(TEXT),
                           r"t.yaml: filter f: the regex '\(x\+x\+\)\+y' ran past its 1 s budget on a "
                           r"5,000-character text")


def test_ordinary_patterns_give_what_re_gives():
    for pattern, text in ((r"#### (\-?[0-9\.\,]+)", "so #### 1,234 and #### -5"), (r"(a)|(b)", "ab"),
                          (r"(?<=x)\d+", "x12 y34"), (r"(\w)\1", "aabb")):
        assert compile_regex(pattern, "w").findall(text) == re.findall(pattern, text)
    assert compile_regex(r"\s+", "w").sub("-", "a  b c", count=1) == re.sub(r"\s+", "-", "a  b c", count=1)
    with pytest.raises(LmforgeError, match="w: the regex '\\(unclosed' does not compile"):
        compile_regex("(unclosed", "w")
    with pytest.raises(LmforgeError, match="a regex must be a string"):
        compile_regex(["a"], "w")


def test_task_filters_and_templates_run_under_the_budget(monkeypatch):
    steps = [{"function": "regex", "regex_pattern": EVIL}]
    _refused_within_budget(lambda: apply_filter(steps, TEXT, "t.yaml: filter strict"),
                           "t.yaml: filter strict: the regex")
    # A template renders in the template worker, another process, under a wall-clock deadline (2 s) that
    # on a loaded machine comes before the regex's 1 s of CPU time does, and then says so instead. The
    # regex's budget is what this checks: the deadline is set past it, and the error is the regex's own
    # (raised by its timeout, which counts the worker's CPU time).
    monkeypatch.setattr("lmforge.eval.tasks.rendering.TEMPLATE_SECONDS", 60.0)
    template = "{{ q | regex_replace('" + EVIL + "', '') }}"
    with pytest.raises(TaskError, match=r"docs.jsonl:1: the template .* does not render: regex_replace: the "
                                        r"regex '\(x\+x\+\)\+y' ran past its 1 s budget"):
        render(template, {"q": TEXT}, "docs.jsonl:1")
    assert render("{{ q | regex_replace('a+', 'b') }}", {"q": "caat"}, "w") == "cbt"


def test_a_group_select_past_the_matches_gives_the_fallback():
    steps = [{"function": "regex", "regex_pattern": r"(\d)", "group_select": 5, "fallback": "none"}]
    assert apply_filter(steps, "1 2") == "none"
    assert apply_filter([{**steps[0], "group_select": -1}], "1 2") == "2"


def test_exact_match_regexes_are_checked_at_load_and_budgeted_when_run(tmp_path):
    _refused_within_budget(lambda: M.exact_match(TEXT, "x", regexes_to_ignore=[EVIL]), "regexes_to_ignore")
    assert M.exact_match("The answer: 4", "4", regexes_to_ignore=[r"^.*: "]) == 1.0
    (tmp_path / "docs.jsonl").write_text('{"q": "x", "a": "y"}\n')
    (tmp_path / "t.yaml").write_text("task: t\ndataset_path: docs.jsonl\ndoc_to_text: q\ndoc_to_target: a\n"
                                     "metric_list:\n  - {metric: exact_match, regexes_to_ignore: ['(']}\n")
    with pytest.raises(TaskError, match=r"t.yaml: exact_match.regexes_to_ignore: the regex '\(' does not"):
        load_task(tmp_path / "t.yaml")


def test_peft_target_modules_from_a_file_run_under_the_budget():
    assert _peft_matches("model.layers.0.self_attn.q_proj", r".*\.(q_proj|v_proj)")
    _refused_within_budget(lambda: _peft_matches("x" * 5000, r"(x|xx)+(?!x)\d"), "target_modules")


@pytest.mark.parametrize("template, why", [
    ("{% for i in range(9999) %}{% for j in range(9999) %}{% endfor %}{% endfor %}", "did not finish within"),
    ("{% for i in range(10**6) %}{% endfor %}", "'range' would make 1,000,000 numbers"),
    ("{{ 'x' * 10**10 }}", "would make 10,000,000,000 characters"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
     "{{ ns.s|length }}", "more memory"),
    ("{{ '%99999999999s' % 'x' }}", "characters"),
])
def test_a_task_file_template_that_loops_or_grows_is_refused_in_seconds(template, why, monkeypatch):
    """doc_to_text and the other templates of a task file are someone else's code: they render in the
    template worker, with a deadline and a memory bound, and the refusal names the document."""
    deadline = why == "did not finish within"
    if not deadline:
        # a template that grows is stopped by the memory or size bound, after work that on a loaded
        # machine outlasts the 2 s wall-clock deadline, which would then stop it instead: the bound is
        # what this case checks (by its message), so the deadline is set past it
        monkeypatch.setattr("lmforge.eval.tasks.rendering.TEMPLATE_SECONDS", 60.0)
    # the worker's start (a Python process: seconds on a loaded machine) is not counted against any
    # render: start it before the clock does (a refused render's worker is killed, so each case starts one)
    assert render("{{ q }}", {"q": "x"}, "w") == "x"
    t0 = time.perf_counter()
    match = rf"docs.jsonl:7: the template .* does not render: .*{re.escape(why)}"
    with pytest.raises(TaskError, match=match):
        render(template, {"q": "x"}, "docs.jsonl:7")
    if deadline:  # the deadline is wall clock, whatever the load: 2 s, and room to stop the worker
        assert time.perf_counter() - t0 < 5
    assert render("{{ q }} and {{ q|upper }}\n", {"q": "x"}, "w") == "x and X\n"  # the worker still serves
