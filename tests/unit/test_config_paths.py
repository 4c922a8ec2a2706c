"""The one classification of path keys (config/paths.py): every free-text key of the schema is an input,
an output or explicitly not a path, and the run-dir protection and the job server's rules both read it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from lmforge.config import load_config
from lmforge.config.paths import INPUT, NOT_PATHS, OUTPUT, PATH_KEYS, input_paths, map_paths, string_keys
from lmforge.config.schema import Config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "debug" / "tiny.yaml"


def test_every_free_text_key_of_the_schema_is_classified():
    """By type annotation: a str / Path field, alone or in a union, list or dict, anywhere in the tree
    (optional sections, unions of sections, lists of sections). A new one must be added to PATH_KEYS (with
    its role) or NOT_PATHS, or this fails naming it."""
    found = set(string_keys(Config))
    unclassified = sorted(found - set(PATH_KEYS) - NOT_PATHS)
    assert not unclassified, f"classify these config keys in lmforge/config/paths.py: {unclassified}"
    stale = sorted((set(PATH_KEYS) | NOT_PATHS) - found)
    assert not stale, f"keys classified in lmforge/config/paths.py that the schema no longer has: {stale}"
    assert not set(PATH_KEYS) & NOT_PATHS
    assert {spec.role for spec in PATH_KEYS.values()} == {INPUT, OUTPUT}


def test_the_walk_reaches_every_kind_of_nesting():
    """The walker must see a text field wherever a section can sit, or the test above could not fail."""

    class Leaf(BaseModel):
        path: Path | None = None
        files: list[str] = Field(default_factory=list)
        choice: Literal["a", "b"] = "a"
        count: int = 0

    class A(BaseModel):
        step: Literal["a"] = "a"
        a_file: str = ""

    class B(BaseModel):
        step: Literal["b"] = "b"
        b_files: list[str] = Field(default_factory=list)

    class Root(BaseModel):
        leaf: Leaf = Field(default_factory=Leaf)
        maybe: Leaf | None = None
        steps: list[Annotated[A | B, Field(discriminator="step")]] = Field(default_factory=list)
        table: dict[str, float] = Field(default_factory=dict)

    assert sorted(string_keys(Root)) == sorted([
        "leaf.path", "leaf.files", "maybe.path", "maybe.files", "steps.a_file", "steps.b_files", "table"])


def test_input_paths_come_from_the_classification(tmp_path):
    cfg = load_config(TINY, [f"run.dir={tmp_path / 'run'}", "data.sources=[builtin:python, corpus.txt]",
                             "distill.teacher=teacher", "rl.reward_model=rm",
                             "rl.rewards={reward_model: 1.0}", "sft.template=auto",
                             "train.eval_tasks=[builtin:code, tasks/a.yaml]",
                             "curate.steps=[{step: decontaminate, eval_files: [evals.jsonl]}]"])
    got = dict((k, str(p)) for k, p in input_paths(cfg))
    assert got == {"data.sources": "corpus.txt", "distill.teacher": "teacher", "rl.reward_model": "rm",
                   "train.eval_tasks": "tasks/a.yaml", "curate.steps.eval_files": "evals.jsonl"}
    assert "run.dir" not in got and "data.dir" not in got  # outputs: what the run writes


def test_map_paths_sees_prefixed_values_whole():
    data = {"logging": {"mlflow": {"tracking_uri": "file:/x/mlruns"}}, "curate": {"inputs": ["hf:/d", "a"]},
            "run": {"name": "file:/not/a/path"}}
    seen = []
    out = map_paths(data, lambda key, spec, value: (seen.append((key, spec.split(value))), value.upper())[1])
    assert seen == [("logging.mlflow.tracking_uri", ("file:", "/x/mlruns")), ("curate.inputs", ("hf:", "/d")),
                    ("curate.inputs", ("", "a"))]
    assert out["curate"]["inputs"] == ["HF:/D", "A"] and out["run"]["name"] == "file:/not/a/path"
    assert PATH_KEYS["logging.mlflow.tracking_uri"].split("http://host:5000") is None
