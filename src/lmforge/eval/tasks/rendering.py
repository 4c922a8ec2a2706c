"""A task file's Jinja templates (doc_to_text, doc_to_target, ...) rendered as lm-evaluation-harness
renders them, in the template worker: a task file is someone else's code, so each render is bounded."""

from __future__ import annotations

from typing import Any

from lmforge.eval.tasks.errors import TaskError

TEMPLATE_SECONDS = 2.0  # wall clock one render of a task file's template may take
TEMPLATE_CHARS = 1 << 22  # characters one render may make (a prompt is a few thousand)


def render(source: str, doc: dict, where: str) -> str:
    """A task file's Jinja template (doc_to_text, doc_to_target, ...) rendered with the document's fields
    as lm-evaluation-harness renders it, in the template worker (data/template_sandbox.py): a task file
    is someone else's code, so its render has a deadline, a memory bound and an output bound."""
    from lmforge.data.template_pool import JOB_SECONDS, pool

    job = {"op": "task", "context": _jsonable(doc), "limit": TEMPLATE_CHARS}
    with pool().worker() as w:
        answer = w.run(source, {}, [job], TEMPLATE_SECONDS)[0]
    if "error" not in answer:
        if not answer["complete"]:
            raise TaskError(f"{where}: the template {source[:200]!r} renders more than {TEMPLATE_CHARS:,} "
                            "characters; a prompt is far shorter")
        return answer["text"]
    kind, error = answer["kind"], answer["error"]
    if kind == "timeout":
        within = f"{JOB_SECONDS:g}" if error == "job" else f"{TEMPLATE_SECONDS:g}"
        error = f"it did not finish within {within} s (a loop that does not end, or too much work)"
    elif kind == "memory":
        error = "it needed more memory than a render may use"
    elif kind == "died":
        error = f"it crashed the process rendering it ({error})"
    raise TaskError(f"{where}: the template {source[:200]!r} does not render: {error}")


def _jsonable(doc: Any) -> Any:
    """The document as JSON values (what the worker reads): numpy scalars as numbers, anything else that
    JSON has no type for (bytes, dates) as its text, as Jinja would print it."""
    import json

    def plain(o: Any) -> Any:
        item = getattr(o, "item", None)
        if callable(item):
            try:
                return item()
            except (TypeError, ValueError):
                pass
        tolist = getattr(o, "tolist", None)
        return tolist() if callable(tolist) else str(o)

    try:
        return json.loads(json.dumps(doc, default=plain))
    except (ValueError, RecursionError) as e:
        raise TaskError(f"a document cannot be passed to its template: {e}") from None

