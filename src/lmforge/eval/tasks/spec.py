"""A task file, checked: the `Task` (documents, the doc_to_* fields, few-shot prompts) and the keys and
numbers a task file may give."""

from __future__ import annotations

import ast
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.eval.tasks.errors import TaskError
from lmforge.eval.tasks.rendering import render
from lmforge.utils.bounds import Bound, real, whole

OUTPUT_TYPES = ("multiple_choice", "loglikelihood", "loglikelihood_rolling", "generate_until")
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
MAX_INCLUDE_DEPTH = 8
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

