"""The shape of the servers' code (issue 33): the job server's app is composed of one router per area,
`lmforge.serve` only re-exports, and the old import paths of moved modules keep working."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "lmforge"


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


def test_create_app_is_a_composition_and_no_function_is_long():
    sizes = dict(_functions(SRC / "jobserver" / "app.py"))
    assert sizes["create_app"] < 100, sizes["create_app"]
    files = [SRC / "jobserver" / "app.py", SRC / "jobserver" / "http.py", SRC / "serve" / "server.py",
             *sorted((SRC / "jobserver" / "routes").glob("*.py"))]
    for f in files:
        assert len(f.read_text(encoding="utf-8").splitlines()) < 600, f
        long = [(name, n) for name, n in _functions(f) if n > 100]
        assert not long, (f, long)


def test_the_job_api_keeps_every_route(tmp_path):
    pytest.importorskip("fastapi")
    from lmforge.jobserver.app import create_app

    spec = create_app(tmp_path / "ws", start_runner=False).openapi()
    ops = {(m.upper(), p, op["operationId"], tuple(op["tags"]))
           for p, item in spec["paths"].items() for m, op in item.items()}
    j, a, r = ("jobs",), ("artifacts",), ("rating",)
    assert ops == {
        ("GET", "/health", "health_health_get", ("server",)),
        ("POST", "/v1/jobs", "create_v1_jobs_post", j),
        ("GET", "/v1/jobs", "list_jobs_v1_jobs_get", j),
        ("GET", "/v1/jobs/{job_id}", "get_job_v1_jobs__job_id__get", j),
        ("DELETE", "/v1/jobs/{job_id}", "delete_v1_jobs__job_id__delete", j),
        ("POST", "/v1/jobs/{job_id}/cancel", "cancel_v1_jobs__job_id__cancel_post", j),
        ("POST", "/v1/jobs/{job_id}/resume", "resume_v1_jobs__job_id__resume_post", j),
        ("POST", "/v1/jobs/{job_id}/publish", "publish_v1_jobs__job_id__publish_post", j),
        ("GET", "/v1/jobs/{job_id}/logs", "logs_v1_jobs__job_id__logs_get", j),
        ("GET", "/v1/jobs/{job_id}/events", "events_v1_jobs__job_id__events_get", j),
        ("GET", "/v1/jobs/{job_id}/artifacts", "artifacts_v1_jobs__job_id__artifacts_get", a),
        ("GET", "/v1/jobs/{job_id}/artifacts/{name}", "artifact_v1_jobs__job_id__artifacts__name__get", a),
        # human evaluation (routes/rating.py)
        ("POST", "/v1/studies", "create_v1_studies_post", r),
        ("GET", "/v1/studies", "list_studies_v1_studies_get", r),
        ("GET", "/v1/studies/{study_id}", "get_study_v1_studies__study_id__get", r),
        ("DELETE", "/v1/studies/{study_id}", "delete_v1_studies__study_id__delete", r),
        ("GET", "/v1/studies/{study_id}/items/{index}",
         "get_item_v1_studies__study_id__items__index__get", r),
        ("POST", "/v1/studies/{study_id}/items/{index}", "rate_v1_studies__study_id__items__index__post", r),
        ("GET", "/v1/studies/{study_id}/results", "get_results_v1_studies__study_id__results_get", r),
        ("GET", "/v1/studies/{study_id}/pairs", "get_pairs_v1_studies__study_id__pairs_get", r),
    }


def test_serve_package_only_reexports():
    tree = ast.parse((SRC / "serve" / "__init__.py").read_text(encoding="utf-8"))
    body = tree.body[1:]  # after the docstring
    assert all(isinstance(n, (ast.ImportFrom, ast.Import, ast.Assign)) for n in body), \
        [type(n).__name__ for n in body]
    import lmforge.serve as serve
    from lmforge.serve import engine, server

    for name in serve.__all__:  # each name is the moved object itself, not a copy
        home = engine if name in ("Engine", "EngineBusy", "Event", "SamplingParams") else server
        assert getattr(serve, name) is getattr(home, name), name
    assert serve.PREFIX_CACHE_MB == 256 and serve.MAX_BATCH.check(8, "--max-batch-size") == 8


def test_the_old_process_group_path_is_the_same_functions():
    old = importlib.import_module("lmforge.parallel.init")
    new = importlib.import_module("lmforge.parallel.process_group")
    for name in old.__all__:
        assert getattr(old, name) is getattr(new, name), name
    import lmforge.parallel as parallel

    assert parallel.init_distributed is new.init_distributed and parallel.shutdown is new.shutdown
