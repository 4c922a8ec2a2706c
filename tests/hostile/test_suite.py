"""Every case of the hostile-input suite (tests/hostile/suite.py) as a test: a clear error (or, for a
legitimate input, success), no traceback, no hang, nothing the user had changed."""

from __future__ import annotations

import os

import pytest
from suite import CASES, build_workspace, run_case


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return build_workspace(tmp_path_factory.mktemp("hostile"))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_case(case, pristine, tmp_path):
    if case.needs_non_root and os.geteuid() == 0:
        pytest.skip("root reads and writes past file permissions")
    outcome = run_case(case, pristine, tmp_path)
    assert not outcome.problems(case), f"{outcome.problems(case)}\n--- output ---\n{outcome.output[-3000:]}"
