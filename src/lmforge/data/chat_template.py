"""Chat templates: a conversation rendered to text, with the character spans of the assistant turns.

A template is Jinja, rendered as transformers renders `tokenizer_config.json`'s `chat_template`: in
Jinja's immutable sandbox, with trim_blocks / lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`, a `tojson` that does not escape HTML, and the special tokens of the tokenizer config
(`bos_token`, `eos_token`, ...).

A template from someone else's model dir is untrusted code, and the sandbox bounds what it may reach,
not how much it works: every template but lmforge's own (ChatML, trusted by its exact text) renders in
a worker process under a work budget (lmforge.data.template_sandbox, lmforge.data.template_pool):
RENDER_SECONDS of wall clock per conversation and a bounded address space, with the operations that
build big values refused up front. A render past the budget is stopped and is a TemplateError naming
the template.

Renders are cut at a number of characters (`limit`): what a sequence length of tokens can hold
(Tokenizer.text_budget), so preparing a conversation far longer than the context costs what its first
part costs. `Rendered.complete` says whether the conversation ended before the cut.

Which characters are the assistant's (what the loss is taken on):
  - a template that marks them with `{% generation %} ... {% endgeneration %}` (transformers' and
    TRL's convention) gives them exactly;
  - otherwise each assistant turn k is what rendering messages[:k+1] adds to rendering messages[:k]
    with the generation prompt; a template for which that is not a prefix (one that renders earlier
    turns differently once later ones exist) cannot be masked this way and is a clear error.

lmforge's own template is ChatML (`<|im_start|>role\\n ... <|im_end|>\\n`), whose assistant span covers
the reply and its `<|im_end|>`, so a fine-tuned model learns to end its turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.data import template_sandbox as sandbox
from lmforge.errors import DataError
from lmforge.utils.jsontext import BadJSON, loads

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
CHATML_END = "<|im_end|>"
TRUSTED = frozenset({CHATML})  # templates lmforge ships: rendered in-process
TEMPLATE_FILE = "chat_template.jinja"
RENDER_SECONDS = 2.0  # wall clock one conversation's render may take in the worker
MAX_TEMPLATE_CHARS = 1 << 20  # the longest templates in use are tens of kilobytes
MAX_RENDER_CHARS = 1 << 24  # a render that no sequence length bounds (an eval prompt) stops here


class TemplateError(DataError):
    """A template that does not compile or fails to render a conversation; `index`: which conversation
    of a batch (None for one)."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


@dataclass(frozen=True)
class Rendered:
    text: str  # at most the render's limit of characters
    spans: list[tuple[int, int]]  # (start, end) of the assistant turns within `text` (span renders)
    complete: bool  # False: the conversation goes on past the cut


class ChatTemplate:
    """A Jinja chat template with the special tokens it may refer to.

    `render(messages, add_generation_prompt)` is the text; `assistant_spans(messages)` the text and the
    (start, end) character spans of the assistant turns, in order; `render_batch` either for many
    conversations at once (one round trip to the worker), cut at `limit` characters.
    """

    def __init__(
        self,
        source: str,
        special_tokens: dict[str, str] | None = None,
        name: str = "chat template",
        end_of_turn: str | None = None,
        variables: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(source, str) or not source.strip():
            raise TemplateError(f"{name} is empty")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise TemplateError(f"{name} is {len(source):,} characters long; a chat template is at most "
                                f"{MAX_TEMPLATE_CHARS:,}")
        self.source = source
        self.name = name
        self.special_tokens = dict(special_tokens or {})
        self.end_of_turn = end_of_turn  # the token a reply ends with (what generation stops at)
        # Extra variables of every render (sft.template_kwargs: Qwen3's enable_thinking, ...).
        self.variables = dict(variables or {})
        self.trusted = source in TRUSTED
        self.tracks_generation = sandbox.has_generation_tag(source)
        self._run([{"op": "compile"}])  # fail now, not on the first conversation

    @classmethod
    def chatml(cls, variables: dict[str, Any] | None = None) -> ChatTemplate:
        return cls(CHATML, {}, name="lmforge's ChatML template", end_of_turn=CHATML_END, variables=variables)

    def with_variables(self, variables: dict[str, Any]) -> ChatTemplate:
        """This template rendering with `variables` instead of its own."""
        if variables == self.variables:
            return self
        return ChatTemplate(self.source, self.special_tokens, name=self.name, end_of_turn=self.end_of_turn,
                            variables=variables)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False,
               tools: Sequence[dict] | None = None) -> str:
        r = self.render_batch([messages], add_generation_prompt=add_generation_prompt, tools=[tools])[0]
        return self._whole(r).text

    def assistant_spans(self, messages: Sequence[dict], tools: Sequence[dict] | None = None
                        ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant turns (one per turn)."""
        r = self._whole(self.render_batch([messages], spans=True, tools=[tools])[0])
        return r.text, r.spans

    def render_batch(self, conversations: Sequence[Sequence[dict]], *, spans: bool = False,
                     add_generation_prompt: bool = False, limit: int | None = None,
                     tools: Sequence[Sequence[dict] | None] | None = None) -> list[Rendered]:
        """Each conversation rendered and cut at `limit` characters (MAX_RENDER_CHARS when None), with
        its assistant spans when `spans`; TemplateError (its `index` the conversation's) for the first
        one the template fails on. tools: each conversation's function definitions (the template's
        `tools`, as apply_chat_template(tools=...) passes them), None where it has none."""
        limit = MAX_RENDER_CHARS if limit is None else limit
        op = {"op": "spans"} if spans else {"op": "render", "gen": add_generation_prompt}
        jobs = [{**op, "messages": [dict(m) for m in c], "limit": limit} for c in conversations]
        for job, t in zip(jobs, tools or ()):
            if t is not None:
                job["tools"] = list(t)
        return [Rendered(a["text"], [tuple(s) for s in a["spans"]], a["complete"]) for a in self._run(jobs)]

    def _whole(self, r: Rendered) -> Rendered:
        if not r.complete:
            raise TemplateError(f"{self.name} rendered more than {MAX_RENDER_CHARS:,} characters for one "
                                "conversation; shorten the conversation or fix the template")
        return r

    def _run(self, jobs: list[dict]) -> list[dict]:
        if self.trusted:
            answers = []
            for job in jobs:
                answers.append(sandbox.run_job(self.source, self._context(), job))
                if "error" in answers[-1]:
                    break
        else:
            from lmforge.data.template_pool import pool

            with pool().worker() as w:
                answers = w.run(self.source, self._context(), jobs, RENDER_SECONDS)
        for i, answer in enumerate(answers):
            if "error" in answer:
                raise TemplateError(self._why(answer), index=None if len(jobs) == 1 else i)
        return answers

    def _context(self) -> dict[str, Any]:
        """The variables of every render besides the conversation: special tokens, then template_kwargs."""
        return {**self.special_tokens, **self.variables}

    def _why(self, answer: dict) -> str:
        kind, error = answer["kind"], answer["error"]
        if kind == "compile":
            return f"{self.name} does not compile: {error}"
        if kind == "prefix":
            return f"{self.name} {error}"
        if kind == "timeout":
            from lmforge.data.template_pool import JOB_SECONDS

            within = f"{JOB_SECONDS:g} s in all" if error == "job" else f"{RENDER_SECONDS:g} s"
            return (f"{self.name} did not finish rendering a conversation within {within} (a loop that "
                    "does not end, or too much work) and was stopped; fix the template or use another one")
        if kind == "memory":
            return (f"{self.name} needed more than {sandbox.MEMORY_BUDGET >> 20} MiB to render a "
                    "conversation and was stopped; fix the template or use another one")
        if kind == "died":
            return (f"{self.name} crashed the process rendering it ({error}); fix the template or use "
                    "another one")
        return f"{self.name} failed to render the conversation: {error}"


def stop_ids(template: ChatTemplate, tokenizer) -> set[int]:
    """Ids a reply ends at: the template's end-of-turn token and the tokenizer's EOS."""
    ids = {tokenizer.eos_id}
    if template.end_of_turn and tokenizer.token_id(template.end_of_turn) is not None:
        ids.add(tokenizer.token_id(template.end_of_turn))
    return ids


# -- the template that ships with a tokenizer ---------------------------------------------------------
def tokenizer_template(tok_file: Path | None, tok, variables: dict[str, Any] | None = None
                       ) -> ChatTemplate | None:
    """The chat template that ships with the tokenizer file `tok_file` (a Hugging Face model dir's),
    with the special tokens of its tokenizer_config.json; None when it has none."""
    config = tokenizer_config(tok_file)
    own = shipped_template(tok_file, config)
    if own is None:
        return None
    specials = template_specials(config, tok)
    return ChatTemplate(own[0], specials, name=own[1], end_of_turn=specials.get("eos_token"),
                        variables=variables)


def template_specials(config: dict, tok) -> dict[str, str]:
    """The special tokens a template may refer to (`bos_token`, `eos_token`, ...): tokenizer_config's,
    and for lmforge's own tokenizers (which have none) the EOS as `eos_token`."""
    specials = {k: t for k, v in config.items() if k.endswith("_token") and (t := _token_text(v)) is not None}
    specials.setdefault("eos_token", tok.hf.id_to_token(tok.eos_id))
    return specials


def tokenizer_config(tok_file: Path | None) -> dict:
    """tokenizer_config.json beside `tok_file` ({} when there is none)."""
    if tok_file is None:
        return {}
    path = tok_file.parent / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = loads(read_text(path))
    except BadJSON as e:
        raise DataError(f"{path}: not valid JSON ({e.why})") from None
    return config if isinstance(config, dict) else {}


def shipped_template(tok_file: Path | None, config: dict) -> tuple[str, str] | None:
    """(source, name) of the template that ships with a tokenizer: chat_template.jinja beside it (as
    transformers >= 4.50 saves it), else tokenizer_config.json's chat_template: a string, or a list of
    {"name", "template"} of which "default" is the one applied (as transformers applies it)."""
    if tok_file is None:
        return None
    jinja = tok_file.parent / TEMPLATE_FILE
    if jinja.is_file():
        return read_text(jinja), f"the chat template {jinja}"
    where = f"the chat template of {tok_file.parent / 'tokenizer_config.json'}"
    value = config.get("chat_template")
    if value is None:
        return None
    if isinstance(value, str):
        return value, where
    if not isinstance(value, list):
        raise TemplateError(f"{where} must be a string or a list of {{\"name\": ..., \"template\": ...}}, "
                            f"not {type(value).__name__} {json.dumps(value)[:60]}")
    named = {}
    for i, entry in enumerate(value):
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)):
            raise TemplateError(f"{where}: entry {i} is {json.dumps(entry)[:80]}; each entry must be "
                                '{"name": "...", "template": "..."} with both strings')
        named[entry["name"]] = entry["template"]
    if "default" not in named:
        raise TemplateError(f"{where} names templates {', '.join(map(repr, named)) or '(none)'} but no "
                            '"default", the one a conversation is rendered with')
    return named["default"], f"{where} (\"default\")"


def read_text(path: Path) -> str:
    """A template or config file as text (a UTF-8 byte order mark dropped), or DataError saying why not."""
    try:
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror})") from None


def _token_text(v) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None
