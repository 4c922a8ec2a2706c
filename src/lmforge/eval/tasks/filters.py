"""Filters of a generation task's responses (the harness's `filter_list`: regex, take_first, lowercase,
uppercase, strip), checked when the task file is loaded and applied before the metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmforge.eval.tasks.errors import TaskError
from lmforge.eval.tasks.spec import BOUNDS
from lmforge.utils.safe_regex import compile_regex

FILTERS = {"regex", "take_first", "lowercase", "uppercase", "strip"}
DEFAULT_REGEX = r"#### (\-?[0-9\.\,]+)"  # the harness's regex filter default (GSM8K's answer line)


def parse_filters(filter_list: Any, path: Path) -> list[tuple[str, list[dict]]]:
    if filter_list is None:
        return [("none", [])]
    if not isinstance(filter_list, list) or not filter_list:
        raise TaskError(f"{path}: key 'filter_list' must be a non-empty list")
    out = []
    for i, item in enumerate(filter_list):
        steps = item.get("filter") if isinstance(item, dict) else None
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not isinstance(steps, list):
            raise TaskError(f"{path}: filter_list[{i}] needs a 'name' and a 'filter' list")
        for j, step in enumerate(steps):
            fn = step.get("function") if isinstance(step, dict) else None
            if fn not in FILTERS:
                raise TaskError(
                    f"{path}: filter_list[{i}].filter[{j}] function {fn!r} is not supported "
                    f"({', '.join(sorted(FILTERS))})"
                )
            if fn == "regex":
                where = f"{path}: filter_list[{i}].filter[{j}]"
                compile_regex(step.get("regex_pattern", DEFAULT_REGEX), f"{where} regex_pattern", TaskError)
                BOUNDS["group_select"].check(step.get("group_select", 0), f"{where} group_select", TaskError)
                if not isinstance(step.get("fallback", ""), str):
                    raise TaskError(f"{where} fallback must be a string")
        out.append((item["name"], steps))
    return out


def apply_filter(steps: list[dict], response: str, where: str = "a task's regex filter") -> str:
    """One response through a filter pipeline (the harness's regex / take_first / case / strip); a regex
    runs under the time budget of utils/safe_regex.py (`where` names the filter in its error). A
    group_select past the matches found gives the fallback, as no match does."""
    for step in steps:
        fn = step["function"]
        if fn == "regex":
            pattern = compile_regex(step.get("regex_pattern", DEFAULT_REGEX), where, TaskError)
            found = pattern.findall(response)
            pick = int(step.get("group_select", 0))
            if found and -len(found) <= pick < len(found):
                match = found[pick]
                if isinstance(match, tuple):
                    match = next((m for m in match if m), step.get("fallback", "[invalid]"))
                response = match.strip()
            else:
                response = step.get("fallback", "[invalid]")
        elif fn == "lowercase":
            response = response.lower()
        elif fn == "uppercase":
            response = response.upper()
        elif fn == "strip":
            response = response.strip()
        # take_first: one response per document already
    return response

