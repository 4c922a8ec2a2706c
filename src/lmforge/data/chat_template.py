"""Chat templates: a conversation rendered to text, with the character spans of the assistant turns.

A template is Jinja, rendered as transformers renders `tokenizer_config.json`'s `chat_template`: in
Jinja's immutable sandbox (a template from someone else's model dir is untrusted code), with
trim_blocks / lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that does not
escape HTML, and the special tokens of the tokenizer config (`bos_token`, `eos_token`, ...).

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
from datetime import datetime
from functools import lru_cache
from typing import Any

from lmforge.errors import DataError

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


class TemplateError(DataError):
    """A template that does not compile or fails to render a conversation."""


@lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: records the character span its body renders to."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(
                self.call_method("_span", [jinja2.nodes.ContextReference()]), [], [], body
            ).set_lineno(lineno)

        def _span(self, context, caller):
            text = caller()
            spans = context.get("__spans__")
            if spans is not None:
                # The marker is unique text: where it lands in the output is where this block starts
                # (the body can be preceded by any amount of text rendered outside this call).
                spans.append(text)
                return f"\x00gen{len(spans) - 1}\x00"
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TemplateError(
            f"the chat template does not compile: {e.message} (template line {e.lineno})"
        ) from None


class ChatTemplate:
    """A Jinja chat template with the special tokens it may refer to.

    `render(messages, add_generation_prompt)` is the text; `assistant_spans(messages)` the text and the
    (start, end) character spans of the assistant turns, in order.
    """

    def __init__(
        self,
        source: str,
        special_tokens: dict[str, str] | None = None,
        name: str = "chat template",
        end_of_turn: str | None = None,
    ) -> None:
        if not isinstance(source, str) or not source.strip():
            raise TemplateError(f"{name} is empty")
        self.source = source
        self.name = name
        self.special_tokens = dict(special_tokens or {})
        self.end_of_turn = end_of_turn  # the token a reply ends with (what generation stops at)
        self.tracks_generation = "generation" in source and _has_generation_tag(source)
        _compile(source)  # fail now, not on the first conversation

    @classmethod
    def chatml(cls) -> ChatTemplate:
        return cls(CHATML, {}, name="lmforge's ChatML template", end_of_turn=CHATML_END)

    def render(self, messages: list[dict] | tuple[dict, ...], add_generation_prompt: bool = False) -> str:
        text, _ = self._render(messages, add_generation_prompt, track=False)
        return text

    def assistant_spans(self, messages: list[dict] | tuple[dict, ...]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant turns (one per turn)."""
        if self.tracks_generation:
            return self._render(messages, False, track=True)
        text = self.render(messages)
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:k], add_generation_prompt=True)
            through = self.render(messages[: k + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise TemplateError(
                    f"{self.name} renders earlier turns differently once later ones follow, so the assistant "
                    "tokens cannot be found by rendering prefixes; use a template that marks them with "
                    "{% generation %} ... {% endgeneration %} (sft.template), or sft.loss_on=all"
                )
            spans.append((len(before), len(through)))
        return text, spans

    def _render(
        self, messages, add_generation_prompt: bool, track: bool
    ) -> tuple[str, list[tuple[int, int]]]:
        import jinja2

        pieces: list[str] = []
        variables: dict[str, Any] = {
            **self.special_tokens,
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        if track:
            variables["__spans__"] = pieces
        try:
            text = _compile(self.source).render(**variables)
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(f"{self.name} failed to render the conversation: {e}") from None
        except Exception as e:  # a template is code: any error in it is the template's, reported as such
            raise TemplateError(
                f"{self.name} failed to render the conversation: {type(e).__name__}: {e}"
            ) from None
        if not track:
            return text, []
        out, spans, pos = [], [], 0
        for i, piece in enumerate(pieces):
            marker = f"\x00gen{i}\x00"
            at = text.find(marker, pos)
            if at < 0:  # the block's output was dropped or transformed by the template: no span for it
                continue
            out.append(text[pos:at])
            start = sum(map(len, out))
            out.append(piece)
            spans.append((start, start + len(piece)))
            pos = at + len(marker)
        out.append(text[pos:])
        return "".join(out), spans


def _has_generation_tag(source: str) -> bool:
    import re

    return re.search(r"\{%-?\s*generation\s*-?%\}", source) is not None


def stop_ids(template: ChatTemplate, tokenizer) -> set[int]:
    """Ids a reply ends at: the template's end-of-turn token and the tokenizer's EOS."""
    ids = {tokenizer.eos_id}
    if template.end_of_turn and tokenizer.token_id(template.end_of_turn) is not None:
        ids.add(tokenizer.token_id(template.end_of_turn))
    return ids
