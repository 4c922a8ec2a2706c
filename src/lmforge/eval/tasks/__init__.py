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

The package, one idea a module: spec (the Task, and the keys and numbers a task file may give), loading
(task file -> Task), rendering (templates in the sandboxed worker), filters, metrics (the registry of
every metric a task file may name: a new metric is one decorated function there) and runners (a Task
on a Scorer -> TaskResult). Everything is imported from `lmforge.eval.tasks` as before.
"""

from lmforge.eval.tasks.errors import TaskError
from lmforge.eval.tasks.filters import DEFAULT_REGEX, FILTERS, apply_filter
from lmforge.eval.tasks.loading import DATA_SUFFIXES, discover, load_task, load_tasks
from lmforge.eval.tasks.metrics import REGISTRY, Metric, metric
from lmforge.eval.tasks.rendering import TEMPLATE_CHARS, TEMPLATE_SECONDS, render
from lmforge.eval.tasks.runners import (
    TaskResult,
    check_limit,
    first_of_each,
    require_code_sandbox,
    run_task,
    select,
)
from lmforge.eval.tasks.spec import (
    BOUNDS,
    CODE_KEYS,
    IGNORED_KEYS,
    KNOWN_KEYS,
    MAX_INCLUDE_DEPTH,
    OUTPUT_TYPES,
    Task,
)

__all__ = [
    "BOUNDS",
    "CODE_KEYS",
    "DATA_SUFFIXES",
    "DEFAULT_REGEX",
    "FILTERS",
    "IGNORED_KEYS",
    "KNOWN_KEYS",
    "MAX_INCLUDE_DEPTH",
    "OUTPUT_TYPES",
    "REGISTRY",
    "TEMPLATE_CHARS",
    "TEMPLATE_SECONDS",
    "Metric",
    "Task",
    "TaskError",
    "TaskResult",
    "apply_filter",
    "check_limit",
    "discover",
    "first_of_each",
    "load_task",
    "load_tasks",
    "metric",
    "render",
    "require_code_sandbox",
    "run_task",
    "select",
]
