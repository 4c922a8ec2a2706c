"""A training method lives in its own files (issue 33): its facts and settings in the config union
(config/methods.py), its objective in engine/objectives/, its setup in assembly/methods/. No other code
spells a method's name or isinstance-checks a concrete objective class: it asks the facts
(`method_facts(cfg)`) or the method's setup (`method_setup(cfg)`)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import lmforge
from lmforge.config.methods import METHOD_CONFIGS
from lmforge.engine import objectives
from lmforge.engine.objectives.base import Objective

SRC = Path(lmforge.__file__).parent
# the methods' own files (cli/verbs/method_verbs.py: their CLI verbs, kept free of pydantic for --help)
OWN = ("config/methods.py", "cli/verbs/method_verbs.py", "engine/objectives/", "assembly/methods/")
# A method's name spelled where it means something else: (file, string) -> what it is there.
OTHER_MEANINGS = {
    ("metrics/console.py", "reward"): "the RL reward metric's key in a train record",
    ("metrics/curves.py", "reward"): "the RL reward metric's key in metrics.jsonl",
    ("data/sft.py", "sft"): "the kind of a prepared chat data dir (conversations), written in its meta",
    ("tools/constitution.py", "sft"): "the count of revised answers it writes to sft.jsonl",
    ("tools/estimate_measure.py", "sft"): "the measured cases: configs, as a YAML file names a method",
    ("tools/estimate_measure.py", "dpo"): "the measured cases: configs, as a YAML file names a method",
    ("tools/estimate_measure.py", "reward"): "the measured cases: configs, as a YAML file names a method",
    ("eval/tasks/spec.py", "tag"): "a key of an lm-evaluation-harness task YAML that lmforge ignores",
}


def _concrete_objectives() -> set[str]:
    seen, todo = set(), [Objective]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            todo.append(sub)
            if not inspect.isabstract(sub) and sub.__module__.startswith(objectives.__name__):
                seen.add(sub.__name__)
    return seen


METHODS = set(METHOD_CONFIGS)
CLASSES = _concrete_objectives()


def violations(text: str, rel: str) -> list[str]:
    """Where `text` (the source of src/lmforge/`rel`) names a method or isinstance-checks a concrete
    objective class, as 'file:line: what'."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.Constant) and node.value in METHODS
                and (rel, node.value) not in OTHER_MEANINGS):
            found.append(f"{rel}:{node.lineno}: the method name {node.value!r}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and node.args[1:]:
            names = {getattr(n, "id", None) or getattr(n, "attr", None) for n in ast.walk(node.args[1])}
            for cls in sorted(names & CLASSES):
                found.append(f"{rel}:{node.lineno}: isinstance on the objective class {cls}")
    return sorted(found)


def test_the_check_sees_what_it_looks_for():
    assert CLASSES >= {"CausalLM", "SFT", "Preference", "KTO", "RewardModel", "PolicyGradient", "Distill",
                       "MaskedLM"}
    assert "TokenObjective" not in CLASSES  # a base class: a capability, not a method
    bad = 'if cfg.objective.name in ("dpo", "x"):\n    pass\nif isinstance(o, (Distill, int)):\n    pass\n'
    assert violations(bad, "train/x.py") == ["train/x.py:1: the method name 'dpo'",
                                             "train/x.py:3: isinstance on the objective class Distill"]
    assert violations('KIND = "sft"', "data/sft.py") == []  # another meaning, listed
    assert violations('f"objective {name} or sft.data"', "x.py") == []  # prose, not a name


def test_no_code_outside_a_methods_own_files_names_it():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if not rel.startswith(OWN):
            found += violations(path.read_text(encoding="utf-8"), rel)
    assert not found, "ask method_facts(cfg) or method_setup(cfg) instead:\n" + "\n".join(found)


def test_other_meanings_are_still_there():
    # a stale entry would let a later, real use of the name through unseen
    for rel, name in OTHER_MEANINGS:
        text = (SRC / rel).read_text(encoding="utf-8")
        assert any(isinstance(n, ast.Constant) and n.value == name for n in ast.walk(ast.parse(text))), rel
