"""A study's generated answers come from a child process held to the server's per-job bounds, never from
the server's own process: a child over the memory bound is killed and the study says why, a run dir that
cannot answer fails with the child's one-line reason, and a good run's answers equal in-process greedy."""

from __future__ import annotations

import pytest

from conftest import TINY, tiny_overrides
from lmforge.config import load_config
from lmforge.jobserver.rating_gen import answers_in_child, generate_answers
from lmforge.train.trainer import train

PROMPTS = ["Tell me a story.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, shared_data_dir):
    d = tmp_path_factory.mktemp("gen") / "run"
    train(load_config(TINY, tiny_overrides(d, shared_data_dir, "train.max_steps=2")))
    return d


def test_child_answers_equal_in_process_greedy(run_dir, tmp_path):
    got = answers_in_child(run_dir, PROMPTS, 6, max_memory=8 * 2**30, threads=1, work=tmp_path)
    assert got == generate_answers(run_dir, PROMPTS, 6)


def test_a_child_over_the_memory_bound_is_killed(run_dir, tmp_path):
    with pytest.raises(RuntimeError, match="--max-memory-gb"):
        answers_in_child(run_dir, PROMPTS, 6, max_memory=2**20, threads=1, work=tmp_path)


def test_a_run_that_cannot_answer_fails_with_its_reason(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(RuntimeError, match="could not answer"):
        answers_in_child(tmp_path / "run", PROMPTS, 6, max_memory=8 * 2**30, threads=1, work=tmp_path)
