"""Evaluation tasks in lm-evaluation-harness's YAML format (the common subset), run on a `Scorer`.

A task file names its documents (a local JSONL / JSON / Parquet file or a saved `datasets` dir, as
`dataset_path: json` + `dataset_kwargs.data_files`, or a path), how a document becomes a prompt
(`doc_to_text`), its answer (`doc_to_target`) and, for multiple choice, its choices (`doc_to_choice`):
each a document field, a Jinja template (rendered in a sandbox, with the harness's `regex_replace`
filter) or a literal. `output_type` is one of

  multiple_choice        log-likelihood of each choice after the prompt: acc, acc_norm (per character
                         of the choice, as the harness), brier_score; calibration from the choices'
                         softmax;
  loglikelihood          log-likelihood of the target: perplexity, acc (the target is the greedy reply);
  loglikelihood_rolling  log-likelihood of the whole target text: word_perplexity, byte_perplexity,
                         bits_per_byte;
  generate_until         greedy generation cut at `generation_kwargs.until` (at most max_gen_toks
                         tokens), through the task's `filter_list` (regex, take_first, lowercase,
                         uppercase, strip), scored by exact_match (with the harness's normalisation
                         options), f1, bleu, chrf, rouge1 / rouge2 / rougeL.

Prompts are built as the harness builds them: description, then `num_fewshot` solved examples
(text + target_delimiter + answer + fewshot_delimiter), then the document's text; a multiple-choice
continuation is target_delimiter + choice. Few-shot examples come from fewshot_split (else the
training, validation, then test split), never the document itself; the default sampler draws them
with a generator seeded by (seed, document index), so a document's prompt does not depend on
--limit or on the other documents (the harness draws from one stream shared by all documents, so
its few-shot prompts differ from ours; `fewshot_config: {sampler: first_n}` is the same in both).

No code runs from a task file: `!function` entries and Python hooks (process_docs, process_results)
are refused with a message naming the file and key.
"""

from __future__ import annotations

import ast
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from lmforge.errors import LmforgeError
from lmforge.eval import metrics as M
from lmforge.utils.bounds import Bound, real, whole
from lmforge.utils.safe_regex import compile_regex
from lmforge.utils.safe_yaml import load_yaml, read_yaml_text

OUTPUT_TYPES = ("multiple_choice", "loglikelihood", "loglikelihood_rolling", "generate_until")
DEFAULT_METRICS = {
    "multiple_choice": ["acc", "acc_norm", "brier_score"],
    "loglikelihood": ["perplexity", "acc"],
    "loglikelihood_rolling": ["word_perplexity", "byte_perplexity", "bits_per_byte"],
    "generate_until": ["exact_match"],
}
METRICS = {
    "multiple_choice": {"acc", "acc_norm", "brier_score", "acc_bytes"},
    "loglikelihood": {"perplexity", "acc"},
    "loglikelihood_rolling": {"word_perplexity", "byte_perplexity", "bits_per_byte"},
    "generate_until": {"exact_match", "f1", "bleu", "chrf", "rouge1", "rouge2", "rougeL", "pass_at_k"},
}
# Keys of harness task files that lmforge reads, and keys it accepts and ignores (grouping, metadata).
KNOWN_KEYS = {
    "task",
    "dataset_path",
    "dataset_name",
    "dataset_kwargs",
    "test_split",
    "validation_split",
    "training_split",
    "fewshot_split",
    "output_type",
    "doc_to_text",
    "doc_to_target",
    "doc_to_choice",
    "target_delimiter",
    "fewshot_delimiter",
    "description",
    "num_fewshot",
    "fewshot_config",
    "generation_kwargs",
    "metric_list",
    "filter_list",
    "include",
    "chance",
    "repeats",
}
IGNORED_KEYS = {
    "tag",
    "group",
    "metadata",
    "should_decontaminate",
    "doc_to_decontamination_query",
    "task_alias",
    "group_alias",
    "dataset_revision",
    "unsafe_code",
}
CODE_KEYS = {"process_docs", "process_results", "doc_to_image", "doc_to_audio", "custom_dataset", "class"}
FILTERS = {"regex", "take_first", "lowercase", "uppercase", "strip"}
MAX_INCLUDE_DEPTH = 8
DEFAULT_REGEX = r"#### (\-?[0-9\.\,]+)"  # the harness's regex filter default (GSM8K's answer line)
# The numbers a task file may give, checked when it is loaded (before any document is read or generated):
# wide enough for every lm-evaluation-harness task, narrow enough that no file asks for unbounded work.
BOUNDS: dict[str, Bound] = {
    "repeats": whole(1, 1000),  # generations per document (pass@k's n; the harness's largest is 100s)
    "num_fewshot": whole(0, 1000),  # examples per prompt (the harness uses at most a few dozen)
    "generation_kwargs.max_gen_toks": whole(1, 1 << 17),  # long-reasoning tasks ask for 32k
    "generation_kwargs.temperature": real(0.0, 100.0),
    "generation_kwargs.top_k": whole(0, 2**31 - 1),
    "generation_kwargs.top_p": real(0.0, 1.0, lo_open=True),
    "chance": real(0.0, 1.0),  # a chance level of exact_match / f1 / pass@k, all fractions
    "pass_at_k.k": whole(1, 1000),
    "pass_at_k.timeout_s": real(0.0, 600.0, lo_open=True),  # per program
    "pass_at_k.memory_mb": real(64.0, 65536.0),  # per program's address space
    "group_select": whole(-1000, 1000),  # which regex match a filter keeps (negative: from the end)
}


class TaskError(LmforgeError):
    """A task file (or its documents) that cannot be evaluated."""


class _Function:
    """A `!function` node: refused when the task is checked (lmforge runs no code from task files)."""

    def __init__(self, name: str) -> None:
        self.name = name


class _TaskLoader(yaml.SafeLoader):
    pass


_TaskLoader.add_constructor("!function", lambda loader, node: _Function(loader.construct_scalar(node)))


# ------------------------------------------------------------------------------------------- templates


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


# ----------------------------------------------------------------------------------------------- spec


@dataclass
class Task:
    """One task file, checked."""

    name: str
    path: Path
    output_type: str
    doc_to_text: Any
    doc_to_target: Any
    doc_to_choice: Any
    target_delimiter: str
    fewshot_delimiter: str
    description: str
    num_fewshot: int
    sampler: str
    splits: dict[str, list[Path]]  # split name -> files
    eval_split: str
    fewshot_split: str | None
    until: list[str]
    max_gen_toks: int
    temperature: float
    top_k: int | None
    top_p: float | None
    repeats: int  # generations per document (pass@k needs k or more)
    metrics: dict[str, dict]  # metric -> its options (exact_match's normalisation)
    filters: list[tuple[str, list[dict]]]  # (name, steps); [("none", [])] without a filter_list
    chance: float | None  # a known chance level for generation tasks (task key `chance`)
    _docs: dict[str, list[tuple[str, dict]]] = field(default_factory=dict, repr=False)

    # -------------------------------------------------------------------------------- documents

    def docs(self, split: str) -> list[tuple[str, dict]]:
        """(where, document) of a split, in file order."""
        if split not in self._docs:
            from lmforge.data.chat import BadRow, ChatStats, iter_records

            out = []
            for f in self.splits[split]:
                if not f.exists():
                    raise TaskError(f"{self.path}: the {split} data {f} does not exist")
                for _, records in iter_records(f, ChatStats()):
                    for where, doc in records:
                        if isinstance(doc, BadRow) or not isinstance(doc, dict):
                            why = doc.get("why", "") if isinstance(doc, BadRow) else "not a JSON object"
                            raise TaskError(f"{where}: a document must be a JSON object ({why or 'bad row'})")
                        out.append((where, doc))
            if not out:
                raise TaskError(
                    f"{self.path}: the {split} split ({', '.join(map(str, self.splits[split]))}) "
                    "holds no documents"
                )
            self._docs[split] = out
        return self._docs[split]

    def _field(self, spec: Any, doc: dict, where: str, what: str) -> Any:
        """A doc_to_* value for one document: a field name, a template, or a literal."""
        if isinstance(spec, str):
            if spec in doc:
                return doc[spec]
            return render(spec, doc, where)
        return spec  # an int, a list (choices), a dict (choices)

    def text(self, doc: dict, where: str) -> str:
        value = self._field(self.doc_to_text, doc, where, "doc_to_text")
        if not isinstance(value, str):
            raise TaskError(f"{where}: doc_to_text gives {type(value).__name__}, not text")
        return value

    def choices(self, doc: dict, where: str) -> list[str]:
        spec = self.doc_to_choice
        if isinstance(spec, dict):
            value: Any = list(spec.values())
        elif isinstance(spec, str) and spec not in doc:
            rendered = render(spec, doc, where)
            try:
                value = ast.literal_eval(rendered)
            except (SyntaxError, ValueError, MemoryError, RecursionError):  # a document can nest anything
                raise TaskError(
                    f"{where}: doc_to_choice renders {rendered[:80]!r}, not a list literal"
                ) from None
        else:
            value = self._field(spec, doc, where, "doc_to_choice")
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise TaskError(
                f"{where}: doc_to_choice must give a list of strings (got {type(value).__name__})"
            )
        if not value:
            raise TaskError(f"{where}: the choice list is empty")
        return value

    def target(self, doc: dict, where: str) -> Any:
        """The harness's doc_to_target: an int (a choice index), a string, or a list of strings."""
        spec = self.doc_to_target
        if isinstance(spec, str) and spec not in doc:
            value: Any = render(spec, doc, where)
            if value.isdigit() and self.doc_to_choice is not None:
                value = int(value)
            elif len(value) >= 2 and value[0] == "[" and value[-1] == "]":
                try:
                    value = ast.literal_eval(value)
                except (SyntaxError, ValueError, MemoryError, RecursionError):  # a document can nest anything
                    pass
            return value
        return self._field(spec, doc, where, "doc_to_target")

    def gold_index(self, doc: dict, where: str, choices: list[str]) -> int:
        gold = self.target(doc, where)
        if isinstance(gold, bool) or not isinstance(gold, (int, str)):
            raise TaskError(
                f"{where}: a multiple-choice target must be a choice index or a choice's text "
                f"(got {type(gold).__name__})"
            )
        if isinstance(gold, str):
            if gold not in choices:
                raise TaskError(f"{where}: the target {gold!r} is not one of the choices {choices}")
            return choices.index(gold)
        if not 0 <= gold < len(choices):
            raise TaskError(f"{where}: the target index {gold} is outside the {len(choices)} choices")
        return gold

    def target_text(self, doc: dict, where: str) -> str:
        """The answer as text (few-shot examples; references of generation tasks' first target)."""
        gold = self.target(doc, where)
        if self.doc_to_choice is not None and isinstance(gold, int) and not isinstance(gold, bool):
            choices = self.choices(doc, where)
            if not 0 <= gold < len(choices):
                raise TaskError(f"{where}: the target index {gold} is outside the {len(choices)} choices")
            return choices[gold]
        if isinstance(gold, list):
            if not gold:
                raise TaskError(f"{where}: the target list is empty")
            return str(gold[0])
        return str(gold)

    def references(self, doc: dict, where: str) -> list[str]:
        gold = self.target(doc, where)
        if isinstance(gold, list):
            if not gold:
                raise TaskError(f"{where}: the target list is empty")
            return [str(g) for g in gold]
        return [self.target_text(doc, where)]

    # ---------------------------------------------------------------------------------- prompts

    def context(
        self,
        index: int,
        doc: dict,
        where: str,
        num_fewshot: int,
        seed: int,
        chat: Callable[[list[dict]], str] | None = None,
        multiturn: bool = False,
    ) -> str:
        """The prompt of document `index` of the evaluation split, as the harness builds it.

        chat: render the prompt as a conversation with this function (a chat template with the
        generation prompt added), as the harness's --apply_chat_template: the description is the
        system message; each few-shot example a user turn (text + target_delimiter) and an assistant
        turn (answer), collapsed into one user message unless `multiturn` (--fewshot_as_multiturn);
        then the document's text as the last user turn."""
        description = render(self.description, doc, where) if self.description else ""
        turns: list[tuple[str, str, str]] = []  # (role, content, delimiter after it in plain text)
        for sw, sdoc in self._shots(index, doc, num_fewshot, seed):
            turns.append(("user", self.text(sdoc, sw), self.target_delimiter))
            turns.append(("assistant", self.target_text(sdoc, sw), self.fewshot_delimiter))
        turns.append(("user", self.text(doc, where), ""))
        if chat is None:
            return description + "".join(content + delim for _, content, delim in turns)
        messages = [{"role": "system", "content": description}] if description else []
        if multiturn:
            messages += [{"role": role, "content": content} for role, content, _ in turns]
        else:
            messages.append({"role": "user", "content": "".join(c + d for _, c, d in turns)})
        return chat(messages)

    def _shots(self, index: int, doc: dict, n: int, seed: int) -> list[tuple[str, dict]]:
        if n <= 0:
            return []
        if self.fewshot_split is None:
            raise TaskError(f"{self.path}: num_fewshot {n} needs a split to draw examples from")
        pool = self.docs(self.fewshot_split)
        same = self.fewshot_split == self.eval_split
        if same:
            pool = [p for k, p in enumerate(pool) if k != index]
        if len(pool) < n:
            raise TaskError(
                f"{self.path}: num_fewshot {n} but the {self.fewshot_split} split offers only "
                f"{len(pool)} examples"
            )
        if self.sampler == "first_n":
            return pool[:n]
        return random.Random(seed * 1_000_003 + index).sample(pool, n)


# ------------------------------------------------------------------------------------------- loading


def load_task(path: str | Path, num_fewshot: int | None = None) -> Task:
    """A task file, checked: every problem is a TaskError naming the file and the key."""
    path = Path(path)
    raw = _read_yaml(path, depth=0, seen=())
    _refuse_code(raw, path, ())
    unknown = sorted(set(raw) - KNOWN_KEYS - IGNORED_KEYS - CODE_KEYS)
    if unknown:
        raise TaskError(
            f"{path}: unknown key(s) {', '.join(unknown)} (lmforge reads the common subset of "
            f"lm-evaluation-harness task files: {', '.join(sorted(KNOWN_KEYS))})"
        )
    for key in sorted(CODE_KEYS & set(raw)):
        raise TaskError(
            f"{path}: key '{key}' needs Python code or media, which lmforge does not run from "
            "task files; prepare the documents as a file instead"
        )

    def need(key: str, kinds: tuple[type, ...], default: Any = ...) -> Any:
        if key not in raw or raw[key] is None:
            if default is ...:
                raise TaskError(f"{path}: key '{key}' is missing")
            return default
        value = raw[key]
        if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
            names = " or ".join(k.__name__ for k in kinds)
            raise TaskError(f"{path}: key '{key}' must be {names} (got {type(value).__name__})")
        return value

    def bounded(key: str, value: Any) -> Any:
        return BOUNDS[key].check(value, f"{path}: key '{key}'", TaskError)

    name = need("task", (str,), path.stem)
    output_type = need("output_type", (str,), "generate_until")
    if output_type not in OUTPUT_TYPES:
        raise TaskError(f"{path}: output_type '{output_type}' is not one of {', '.join(OUTPUT_TYPES)}")
    doc_to_choice = need("doc_to_choice", (str, list, dict), None)
    if output_type == "multiple_choice" and doc_to_choice is None:
        raise TaskError(f"{path}: key 'doc_to_choice' is missing (a multiple_choice task needs its choices)")
    if isinstance(doc_to_choice, list) and not doc_to_choice:
        raise TaskError(f"{path}: key 'doc_to_choice' is an empty list")
    doc_to_text = need("doc_to_text", (str, int), None if output_type == "loglikelihood_rolling" else ...)
    doc_to_target = need("doc_to_target", (str, int, list))
    splits = _splits(raw, path)
    split_keys = {
        k: need(k, (str,), None)
        for k in ("test_split", "validation_split", "training_split", "fewshot_split")
    }
    for key, split in split_keys.items():
        if split is not None and split not in splits:
            raise TaskError(
                f"{path}: key '{key}' names split '{split}', but the data has only "
                f"{', '.join(sorted(splits))}"
            )
    eval_split = split_keys["test_split"] or split_keys["validation_split"]
    if eval_split is None:
        if len(splits) != 1:
            raise TaskError(
                f"{path}: key 'test_split' is missing (the data has splits {', '.join(sorted(splits))})"
            )
        eval_split = next(iter(splits))
    fewshot_split = (
        split_keys["fewshot_split"]
        or split_keys["training_split"]
        or split_keys["validation_split"]
        or eval_split
    )
    fewshot_config = need("fewshot_config", (dict,), {})
    sampler = fewshot_config.get("sampler", "default")
    if sampler not in ("default", "first_n"):
        raise TaskError(f"{path}: fewshot_config.sampler '{sampler}' is not supported (default or first_n)")
    gen = need("generation_kwargs", (dict,), {})
    until = gen.get("until", [])
    until = [until] if isinstance(until, str) else until
    if not isinstance(until, list) or not all(isinstance(u, str) for u in until):
        raise TaskError(f"{path}: generation_kwargs.until must be a string or a list of strings")
    max_gen_toks = bounded("generation_kwargs.max_gen_toks", gen.get("max_gen_toks", 256))
    unknown_gen = sorted(set(gen) - {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p"})
    if unknown_gen:
        raise TaskError(
            f"{path}: generation_kwargs has unknown key(s) {', '.join(unknown_gen)} (until, "
            "max_gen_toks, do_sample, temperature, top_k, top_p)"
        )
    temperature = 0.0
    if gen.get("do_sample"):  # as transformers: sampling only when asked for, at temperature 1 by default
        temperature = bounded("generation_kwargs.temperature", gen.get("temperature", 1.0))
    top_k, top_p = gen.get("top_k"), gen.get("top_p")
    top_k = None if top_k is None else bounded("generation_kwargs.top_k", top_k)
    top_p = None if top_p is None else bounded("generation_kwargs.top_p", top_p)
    repeats = bounded("repeats", need("repeats", (int,), 1))
    nf = bounded("num_fewshot", need("num_fewshot", (int,), 0) if num_fewshot is None else num_fewshot)
    chance = need("chance", (int, float), None)
    chance = None if chance is None else bounded("chance", chance)
    return Task(
        name=name,
        path=path,
        output_type=output_type,
        doc_to_text=doc_to_text,
        doc_to_target=doc_to_target,
        doc_to_choice=doc_to_choice,
        target_delimiter=need("target_delimiter", (str,), " "),
        fewshot_delimiter=need("fewshot_delimiter", (str,), "\n\n"),
        description=need("description", (str,), ""),
        num_fewshot=nf,
        sampler=sampler,
        splits=splits,
        eval_split=eval_split,
        fewshot_split=fewshot_split,
        until=until,
        max_gen_toks=max_gen_toks,
        temperature=float(temperature),
        top_k=top_k or None,
        top_p=None if top_p is None else float(top_p),
        repeats=repeats,
        metrics=_metrics(raw.get("metric_list"), output_type, path),
        filters=_filters(raw.get("filter_list"), path),
        chance=None if chance is None else float(chance),
    )


def _read_yaml(path: Path, depth: int, seen: tuple[Path, ...]) -> dict:
    if depth > MAX_INCLUDE_DEPTH:
        raise TaskError(f"{path}: includes nest deeper than {MAX_INCLUDE_DEPTH} files")
    try:
        resolved = path.resolve()
    except OSError as e:
        raise TaskError(f"{path}: cannot read the task file ({e.strerror or e})") from None
    if resolved in seen:
        raise TaskError(f"{path}: includes itself (through {' -> '.join(map(str, seen))})")
    if not path.is_file():
        raise TaskError(f"{path}: no such task file")
    try:
        raw = load_yaml(read_yaml_text(path, TaskError), str(path), _TaskLoader, error=TaskError)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        raise TaskError(f"{path}{at}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(raw, dict):
        raise TaskError(
            f"{path}: a task file is a YAML mapping of keys (task, dataset_path, doc_to_text, ...)"
        )
    include = raw.pop("include", None)
    if include is None:
        return raw
    if not isinstance(include, str):
        raise TaskError(f"{path}: key 'include' must be a file name")
    base = _read_yaml(_beside(path, include), depth + 1, (*seen, resolved))
    return {**base, **raw}


def _beside(path: Path, name: str) -> Path:
    p = Path(name)
    return p if p.is_absolute() else path.parent / p


def _refuse_code(value: Any, path: Path, keys: tuple[str, ...]) -> None:
    if isinstance(value, _Function):
        where = ".".join(keys) or "(top level)"
        raise TaskError(
            f"{path}: key '{where}' is `!function {value.name}` (Python code): lmforge runs no "
            "code from task files; use a field name or a Jinja template"
        )
    if isinstance(value, dict):
        for k, v in value.items():
            _refuse_code(v, path, (*keys, str(k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _refuse_code(v, path, (*keys, str(i)))


DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")


def _splits(raw: dict, path: Path) -> dict[str, list[Path]]:
    """Split name -> data files: dataset_kwargs.data_files (a file, a list, or {split: files}) under a
    dataset_path of json / parquet / arrow, or dataset_path itself a file (split 'test') or a dir of
    <split>.<ext> files / a saved datasets dir with one subdir per split. Relative paths are taken from
    the task file's dir when they exist there, else from the current dir."""
    dataset_path = raw.get("dataset_path")
    kwargs = raw.get("dataset_kwargs") or {}
    if not isinstance(dataset_path, str) or not dataset_path:
        raise TaskError(
            f"{path}: key 'dataset_path' is missing (a local file or dir, or json / parquet "
            "with dataset_kwargs.data_files)"
        )
    if not isinstance(kwargs, dict):
        raise TaskError(f"{path}: key 'dataset_kwargs' must be a mapping")

    def local(name: Any, key: str) -> Path:
        if not isinstance(name, str) or not name:
            raise TaskError(f"{path}: key '{key}' must be a file path")
        p = Path(name).expanduser()
        if not p.is_absolute():
            here = path.parent / p
            p = here if here.exists() or not p.exists() else p
        return p

    if dataset_path in ("json", "parquet", "arrow", "csv"):
        if dataset_path == "csv":
            raise TaskError(
                f"{path}: dataset_path csv is not supported; convert the documents to JSONL or Parquet"
            )
        files = kwargs.get("data_files")
        if files is None:
            raise TaskError(f"{path}: dataset_path '{dataset_path}' needs dataset_kwargs.data_files")
        if isinstance(files, dict):
            return {
                str(split): [
                    local(f, f"dataset_kwargs.data_files.{split}")
                    for f in (v if isinstance(v, list) else [v])
                ]
                for split, v in files.items()
            }
        files = files if isinstance(files, list) else [files]
        return {"train": [local(f, "dataset_kwargs.data_files") for f in files]}  # datasets' name for it
    p = local(dataset_path, "dataset_path")
    if p.is_file():
        return {"test": [p]}
    if p.is_dir():
        found: dict[str, list[Path]] = {}
        for child in sorted(p.iterdir()):
            if child.is_file() and child.suffix.lower() in DATA_SUFFIXES:
                found.setdefault(child.stem, []).append(child)
            elif child.is_dir() and any(f.suffix == ".arrow" for f in child.iterdir()):
                found.setdefault(child.name, []).append(child)
        if found:
            return found
        raise TaskError(f"{path}: dataset_path {p} holds no <split>.jsonl / .parquet files or split dirs")
    hub = (
        ""
        if p.exists()
        else (
            " (lmforge reads local data only: nothing is downloaded; give a file or dir)"
            if "/" in dataset_path and not dataset_path.startswith((".", "/"))
            else ""
        )
    )
    raise TaskError(f"{path}: dataset_path {dataset_path!r} is not a file or dir{hub}")


def _metrics(metric_list: Any, output_type: str, path: Path) -> dict[str, dict]:
    if metric_list is None:
        return {m: {} for m in DEFAULT_METRICS[output_type]}
    if not isinstance(metric_list, list) or not metric_list:
        raise TaskError(f"{path}: key 'metric_list' must be a non-empty list of {{metric: name, ...}}")
    out = {}
    for i, item in enumerate(metric_list):
        if not isinstance(item, dict) or not isinstance(item.get("metric"), str):
            raise TaskError(f"{path}: metric_list[{i}] needs a 'metric' name")
        name = item["metric"]
        if name not in METRICS[output_type]:
            raise TaskError(
                f"{path}: metric_list[{i}] '{name}' is not available for {output_type} "
                f"(available: {', '.join(sorted(METRICS[output_type]))})"
            )
        opts = {k: v for k, v in item.items() if k not in ("metric", "aggregation", "higher_is_better")}
        if name == "exact_match":
            allowed = {"ignore_case", "ignore_punctuation", "ignore_numbers", "regexes_to_ignore"}
            bad = sorted(set(opts) - allowed)
            if bad:
                raise TaskError(
                    f"{path}: metric_list[{i}] exact_match has unknown option(s) {', '.join(bad)}"
                )
            regexes = opts.get("regexes_to_ignore", [])
            regexes = [regexes] if isinstance(regexes, str) else regexes
            if not isinstance(regexes, list):
                raise TaskError(f"{path}: metric_list[{i}] exact_match.regexes_to_ignore must be a list of "
                                "regexes")
            for pattern in regexes:  # each compiles (and is kept) under the regex time budget
                compile_regex(pattern, f"{path}: exact_match.regexes_to_ignore", TaskError)
            opts = {**opts, "regexes_to_ignore": regexes} if regexes else opts
        if name == "pass_at_k":
            bad = sorted(set(opts) - {"k", "test", "timeout_s", "memory_mb"})
            if bad:
                raise TaskError(f"{path}: metric_list[{i}] pass_at_k has unknown option(s) {', '.join(bad)}")
            ks = opts.get("k", [1])
            ks = [ks] if isinstance(ks, int) else ks
            if not isinstance(ks, list) or not ks:
                raise TaskError(
                    f"{path}: metric_list[{i}] pass_at_k.k must be a positive integer or a list of them"
                )
            for k in ks:
                BOUNDS["pass_at_k.k"].check(k, f"{path}: metric_list[{i}] pass_at_k.k", TaskError)
            if not isinstance(opts.get("test"), str) or not opts["test"].strip():
                raise TaskError(
                    f"{path}: metric_list[{i}] pass_at_k needs 'test': a document field or a template of "
                    "the test code run after the prompt and the completion (e.g. "
                    '"{{test}}\\ncheck({{entry_point}})")'
                )
            for key in ("timeout_s", "memory_mb"):
                if opts.get(key) is not None:
                    BOUNDS[f"pass_at_k.{key}"].check(opts[key], f"{path}: metric_list[{i}] pass_at_k.{key}",
                                                     TaskError)
            opts = {**opts, "k": ks}
        out[name] = opts
    return out


def _filters(filter_list: Any, path: Path) -> list[tuple[str, list[dict]]]:
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


# ------------------------------------------------------------------------------------------- running


@dataclass
class TaskResult:
    name: str
    output_type: str
    num_fewshot: int
    n_docs: int
    metrics: dict[str, float]  # "acc", "exact_match,strict-match", ...
    stderr: dict[str, float]
    chance: dict[str, float]
    samples: list[dict]
    calibration: dict[str, Any] | None = None  # multiple choice: confidences and hits for ECE

    def to_json(self) -> dict:
        return {
            "task": self.name,
            "output_type": self.output_type,
            "num_fewshot": self.num_fewshot,
            "n_docs": self.n_docs,
            "metrics": self.metrics,
            "stderr": self.stderr,
            "chance": self.chance,
            "calibration": None
            if self.calibration is None
            else {k: v for k, v in self.calibration.items() if k not in ("confidence", "correct")},
        }


def check_limit(limit: float | None) -> None:
    """--limit is a whole number of documents or a fraction below 1 (as the harness); 2.5 or NaN would
    otherwise be cut to a count nobody asked for."""
    if limit is None:
        return
    if not math.isfinite(limit) or limit <= 0 or (limit >= 1 and limit != int(limit)):
        raise LmforgeError(f"--limit {limit:g}: give a whole number of documents (e.g. 100) or a fraction "
                           "below 1 (e.g. 0.1)")


def select(n: int, limit: float | None) -> int:
    """How many documents --limit keeps: an int count, or a fraction below 1 (as the harness)."""
    if limit is None:
        return n
    check_limit(limit)
    return min(n, math.ceil(n * limit) if limit < 1 else int(limit))


def first_of_each(records: list[dict], key: str, limit: float | None) -> list[dict]:
    """--limit applied to each group of `records` (by `key`: a task, a red-team category) on its own, the
    first of each in file order, the order kept."""
    if limit is None:
        return records
    sizes: dict[str, int] = {}
    for r in records:
        sizes[r[key]] = sizes.get(r[key], 0) + 1
    keep = {k: select(n, limit) for k, n in sizes.items()}
    out, taken = [], dict.fromkeys(sizes, 0)
    for r in records:
        if taken[r[key]] < keep[r[key]]:
            taken[r[key]] += 1
            out.append(r)
    return out


def run_task(
    task: Task,
    scorer,
    *,
    limit: float | None = None,
    seed: int = 1234,
    say: Callable[[str], None] | None = None,
    chat: Callable[[list[dict]], str] | None = None,
    multiturn: bool = False,
    code_isolation: str = "os",
) -> TaskResult:
    """Score `scorer` (eval/scorer.py) on the task's evaluation split (with `chat`, prompts are
    conversations: see Task.context; the scorer must then read special tokens in its text).
    code_isolation: how pass@k runs model-written code ("os": the whole sandbox; "hook": the audit hook
    only, --unsafe-code-exec); the caller decides, never the task file."""
    docs = task.docs(task.eval_split)
    docs = docs[: select(len(docs), limit)]
    contexts = [
        task.context(i, d, w, task.num_fewshot, seed, chat, multiturn) for i, (w, d) in enumerate(docs)
    ]
    kind = task.output_type
    if say:
        say(
            f"{task.name}: {len(docs)} documents, {kind}, {task.num_fewshot}-shot"
            + (", chat" if chat else "")
        )
    if kind == "multiple_choice":
        # After a chat prompt the answer starts the assistant's turn: no delimiter (as the harness).
        return _multiple_choice(task, scorer, docs, contexts, "" if chat else task.target_delimiter)
    if kind == "loglikelihood":
        return _loglikelihood(task, scorer, docs, contexts)
    if kind == "loglikelihood_rolling":
        return _rolling(task, scorer, docs)
    return _generate(task, scorer, docs, contexts, seed, code_isolation)


def _result(
    task: Task, docs, per_doc: dict[str, list[float]], samples, chance=None, corpus=None, calibration=None
) -> TaskResult:
    metrics, stderr = {}, {}
    for k, values in per_doc.items():
        metrics[k], stderr[k] = M.mean_and_stderr(values)
    metrics.update(corpus or {})
    return TaskResult(
        task.name,
        task.output_type,
        task.num_fewshot,
        len(docs),
        metrics,
        {k: v for k, v in stderr.items() if not math.isnan(v)},
        chance or {},
        samples,
        calibration,
    )


def _scored(scorer, pairs, where_of: Callable[[int], str]) -> list[tuple[float, bool]]:
    from lmforge.eval.scorer import RequestError

    try:
        return scorer.loglikelihood(pairs)
    except RequestError as e:
        raise TaskError(f"{where_of(e.index)}: {e}") from None


def _multiple_choice(task: Task, scorer, docs, contexts, delimiter: str) -> TaskResult:
    pairs, spans, golds, all_choices = [], [], [], []
    for (where, doc), ctx in zip(docs, contexts):
        choices = task.choices(doc, where)
        golds.append(task.gold_index(doc, where, choices))
        spans.append((len(pairs), len(choices)))
        pairs.extend((ctx, delimiter + c) for c in choices)
        all_choices.append(choices)
    owner = [k for k, (_, n) in enumerate(spans) for _ in range(n)]
    scores = _scored(scorer, pairs, lambda i: docs[owner[i]][0])
    per_doc: dict[str, list[float]] = {m: [] for m in task.metrics}
    samples, conf, hit, probs = [], [], [], []
    for (where, _), ctx, (start, n), gold, choices in zip(docs, contexts, spans, golds, all_choices):
        lls = np.array([s[0] for s in scores[start : start + n]])
        chars = np.array([float(len(c)) for c in choices])
        nbytes = np.array([float(len(c.encode("utf-8"))) for c in choices])
        pred, pred_norm, pred_bytes = (
            int(np.argmax(lls)),
            int(np.argmax(lls / chars)),
            int(np.argmax(lls / nbytes)),
        )
        p = M.softmax(lls)
        probs.append(p)
        conf.append(float(p.max()))
        hit.append(float(pred == gold))
        values = {
            "acc": float(pred == gold),
            "acc_norm": float(pred_norm == gold),
            "acc_bytes": float(pred_bytes == gold),
            "brier_score": M.brier_score([p], [gold]),
        }
        for m in per_doc:
            per_doc[m].append(values[m])
        samples.append(
            {
                "where": where,
                "context": ctx,
                "choices": choices,
                "gold": gold,
                "loglikelihoods": lls.tolist(),
                "pred": pred,
                "pred_norm": pred_norm,
            }
        )
    chance_acc = float(np.mean([1.0 / len(c) for c in all_choices]))
    chance = {m: chance_acc for m in per_doc if m.startswith("acc")}
    if "brier_score" in per_doc:  # the uniform guess
        chance["brier_score"] = float(np.mean([1.0 - 1.0 / len(c) for c in all_choices]))
    calibration = {
        "confidence": conf,
        "correct": hit,
        "ece": M.expected_calibration_error(conf, hit, 10),
        "ece_adaptive": M.expected_calibration_error(conf, hit, 10, adaptive=True),
        "brier_score": M.brier_score(probs, golds),
    }
    return _result(task, docs, per_doc, samples, chance, calibration=calibration)


def _loglikelihood(task: Task, scorer, docs, contexts) -> TaskResult:
    targets = [task.target_text(d, w) for w, d in docs]
    scores = _scored(scorer, list(zip(contexts, targets)), lambda i: docs[i][0])
    samples = [
        {"where": w, "context": c, "target": t, "loglikelihood": ll, "greedy": g}
        for (w, _), c, t, (ll, g) in zip(docs, contexts, targets, scores)
    ]
    per_doc = {"acc": [float(g) for _, g in scores]} if "acc" in task.metrics else {}
    corpus = {}
    if "perplexity" in task.metrics:  # the harness: exp(-mean log-likelihood per document)
        corpus["perplexity"] = math.exp(min(-float(np.mean([ll for ll, _ in scores])), 700.0))
    return _result(task, docs, per_doc, samples, corpus=corpus)


def _rolling(task: Task, scorer, docs) -> TaskResult:
    texts = [task.target_text(d, w) for w, d in docs]
    lls = scorer.rolling_loglikelihood(texts)
    words = sum(len(re.split(r"\s+", t)) for t in texts)  # the harness's count_words
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    total = float(sum(lls))
    corpus = {}
    if "word_perplexity" in task.metrics:
        corpus["word_perplexity"] = math.exp(min(-total / words, 700.0))
    if "byte_perplexity" in task.metrics:
        corpus["byte_perplexity"] = math.exp(min(-total / nbytes, 700.0))
    if "bits_per_byte" in task.metrics:
        corpus["bits_per_byte"] = -total / nbytes / math.log(2)
    samples = [{"where": w, "loglikelihood": ll} for (w, _), ll in zip(docs, lls)]
    return _result(task, docs, {}, samples, corpus=corpus)


def _generate(task: Task, scorer, docs, contexts, seed: int, code_isolation: str = "os") -> TaskResult:
    n = task.repeats
    generations = scorer.generate_until(
        [c for c in contexts for _ in range(n)],
        task.until,
        task.max_gen_toks,
        temperature=task.temperature,
        top_k=task.top_k,
        top_p=task.top_p,
        seed=seed,
    )
    per_sample = [generations[i * n : (i + 1) * n] for i in range(len(contexts))]
    outputs = [
        g[0] for g in per_sample
    ]  # string metrics score the first generation (the harness's take_first)
    refs = [task.references(d, w) for w, d in docs]
    per_doc: dict[str, list[float]] = {}
    corpus: dict[str, float] = {}
    samples = [
        {"where": w, "context": c, "references": r, "response": o}
        for (w, _), c, r, o in zip(docs, contexts, refs, outputs)
    ]
    for fname, steps in task.filters:
        suffix = "" if fname == "none" else f",{fname}"
        preds = [apply_filter(steps, o, f"{task.path}: filter {fname}") for o in outputs]
        for s, p in zip(samples, preds):
            s[f"filtered{suffix}"] = p
        for m, opts in task.metrics.items():
            if m == "exact_match":
                per_doc[m + suffix] = [M.exact_match(p, r, **opts) for p, r in zip(preds, refs)]
            elif m == "f1":
                per_doc[m + suffix] = [M.token_f1(p, r) for p, r in zip(preds, refs)]
            elif m == "bleu":
                corpus[m + suffix] = M.corpus_bleu(preds, refs)
            elif m == "chrf":
                corpus[m + suffix] = M.corpus_chrf(preds, refs)
        rouge_wanted = [m for m in task.metrics if m in M.ROUGE_TYPES]
        if rouge_wanted:
            scores = M.rouge(preds, refs)
            corpus.update({m + suffix: scores[m] for m in rouge_wanted})
    if "pass_at_k" in task.metrics:
        per_doc.update(_pass_at_k(task, docs, contexts, per_sample, samples, code_isolation))
    chance = {}
    if task.chance is not None:
        chance = {k: task.chance for k in per_doc}
    return _result(task, docs, per_doc, samples, chance, corpus=corpus)


def _pass_at_k(task: Task, docs, contexts, per_sample, samples, isolation: str) -> dict[str, list[float]]:
    """Run prompt + completion + the test code of every generation in the sandbox; per document the
    unbiased pass@k estimate from its `repeats` generations (k larger than repeats: not reported)."""
    from lmforge.eval.sandbox import run_many

    opts = task.metrics["pass_at_k"]
    programs = []
    for (where, doc), ctx, gens in zip(docs, contexts, per_sample):
        test = task._field(opts["test"], doc, where, "pass_at_k.test")
        if not isinstance(test, str):
            raise TaskError(f"{where}: pass_at_k.test gives {type(test).__name__}, not code")
        programs.extend(ctx + g + "\n\n" + test + "\n" for g in gens)
    outcomes = run_many(
        programs,
        timeout_s=float(opts.get("timeout_s", 5.0)),
        memory_mb=int(opts.get("memory_mb", 512)),
        isolation=isolation,
    )
    n = task.repeats
    out: dict[str, list[float]] = {f"pass@{k}": [] for k in opts["k"] if k <= n}
    for i, s in enumerate(samples):
        mine = outcomes[i * n : (i + 1) * n]
        c = sum(o.passed for o in mine)
        s["generations"] = per_sample[i]
        s["outcomes"] = [f"{o.status}: {o.detail}" if o.detail else o.status for o in mine]
        for k in out:
            out[k].append(M.pass_at_k(n, c, int(k.split("@")[1])))
    return out


def require_code_sandbox(tasks: Sequence[Task], code_isolation: str, unsafe_hint: str) -> str | None:
    """Before any model loads: where `tasks` run model-written code (pass@k), check that the sandbox can
    run it here (a TaskError saying what is missing and `unsafe_hint`, the caller's way around it).
    Returns how the code will be isolated, in words, or None when no task runs code."""
    from lmforge.eval.sandbox import SandboxUnavailable, check_isolation

    coders = [t.name for t in tasks if "pass_at_k" in t.metrics]
    if not coders:
        return None
    if code_isolation == "hook":
        return "UNSAFE: the in-process audit hook only (--unsafe-code-exec), no operating-system sandbox"
    try:
        return check_isolation()
    except SandboxUnavailable as e:
        raise TaskError(f"{', '.join(coders)}: pass@k runs model-written code: {e}. {unsafe_hint}") from None


def discover(item: str, bundle_dir: Path | None = None) -> list[Path]:
    """Task files named by one --tasks item: a .yaml file, a dir of them, or a shipped task's name."""
    p = Path(item)
    if p.suffix.lower() in (".yaml", ".yml"):
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix.lower() in (".yaml", ".yml"))
        if not files:
            raise TaskError(f"{p}: no task files (.yaml) in this dir")
        return files
    raise TaskError(f"{item}: not a task file (.yaml) or a dir of them")


def load_tasks(items: Sequence[str], num_fewshot: int | None = None) -> list[Task]:
    tasks: list[Task] = []
    for item in items:
        tasks.extend(load_task(f, num_fewshot) for f in discover(item))
    names = [t.name for t in tasks]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise TaskError(f"two task files share the task name(s) {', '.join(dup)}")
    return tasks
