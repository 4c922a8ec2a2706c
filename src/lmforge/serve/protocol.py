"""The request bodies of lmforge's OpenAI-compatible API (OpenAI's / vLLM's field names and meanings),
validated with pydantic, and the small helpers that shape responses and errors.

Unknown fields are refused (OpenAI answers "Unrecognized request argument supplied"), so a client
never believes an option took effect when it did not; fields lmforge does not implement (logprobs,
penalties, ...) are accepted at their neutral values only. Tool calling (tools, tool_choice,
parallel_tool_calls, assistant tool_calls and role "tool" messages) is lmforge.serve.tools'.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from lmforge.data.chat_tools import BadTools, ToolBudget
from lmforge.serve.logprobs import MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS
from lmforge.utils.jsontext import BadJSON, loads

MAX_N = 16  # choices per prompt
MAX_SEQUENCES = 64  # prompts x n per request
MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_STOP_CHARS = 256
MAX_PROMPTS = 32
MAX_LOGIT_BIAS = 300  # tokens a logit_bias may name (OpenAI's limit)
MAX_TOOLS = 128  # functions of one request (OpenAI's limit)
MAX_TOOL_CALLS = 64  # calls of one assistant message
MAX_TOOL_ID_CHARS = 256
MAX_DESCRIPTION_CHARS = 4096  # a function's description

# Neutral values of the fields lmforge accepts but does not implement.
_UNSUPPORTED = {
    "suffix": (None, ""),
    "best_of": (None, 1),
}


def _same(value: Any, neutral: Any) -> bool:
    """`value` is the neutral value itself, not merely equal to it: in Python 0 == False and 1 == True, so
    a plain `in` would let `logprobs: 0` (completions: "the chosen token's log-prob") pass as `false`, or
    `best_of: true` as 1. Numbers match numbers (0 and 0.0), booleans booleans, containers item by item."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    if isinstance(value, (int, float)) and isinstance(neutral, (int, float)):
        return value == neutral
    if isinstance(value, dict) and isinstance(neutral, dict):
        return value.keys() == neutral.keys() and all(_same(value[k], neutral[k]) for k in value)
    if isinstance(value, list) and isinstance(neutral, list):
        return len(value) == len(neutral) and all(map(_same, value, neutral))
    return type(value) is type(neutral) and value == neutral


class _Strict(BaseModel):
    # JSON bodies may spell NaN and Infinity (Python's json reads them); no field of a request takes either
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    """Fields shared by completions and chat completions."""

    model: StrictStr
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="vLLM's extension; -1 or 0: off")
    n: int = Field(1, ge=1, le=MAX_N)
    stop: StrictStr | list[StrictStr] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as OpenAI's abuse-tracking id
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    suffix: Any = None
    best_of: Any = None
    logit_bias: dict[StrictStr, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)

    @field_validator("presence_penalty", "frequency_penalty", mode="before")
    @classmethod
    def _a_number(cls, value):
        if isinstance(value, bool):  # pydantic would read true as 1.0
            raise ValueError(f"takes a number from -2 to 2, got {json.dumps(value)}")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_numbers(cls, bias):
        if isinstance(bias, dict) and any(isinstance(v, bool) for v in bias.values()):
            raise ValueError("values are numbers from -100 to 100, not true or false")
        return bias

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 9):
                raise ValueError(f"keys are token ids (decimal strings), got {json.dumps(key)}")
            if not -100 <= value <= 100:
                raise ValueError(f"values lie in [-100, 100], got {value} for token {key}")
        return bias

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs for the engine."""
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    @model_validator(mode="after")
    def _supported(self):
        for name in sorted(self.model_fields_set & set(_UNSUPPORTED)):
            value = getattr(self, name)
            if not any(_same(value, neutral) for neutral in _UNSUPPORTED[name]):
                got = json.dumps(value, default=repr)
                raise ValueError(f"'{name}' is not supported by lmforge serve (got {got}); leave it out")
        if self.stream_options is not None and not self.stream:
            raise ValueError("'stream_options' is only allowed with 'stream': true")
        stops = self.stop_list()
        if len(stops) > MAX_STOP:
            raise ValueError(f"'stop' takes at most {MAX_STOP} strings, got {len(stops)}")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"each 'stop' string must have 1 to {MAX_STOP_CHARS} characters")
        return self

    def stop_list(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def resolved_top_k(self) -> int | None:
        return None if self.top_k is None or self.top_k <= 0 else self.top_k

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


TokenIds = list[Annotated[StrictInt, Field(ge=0)]]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class TextFormat(_Strict):
    """response_format {"type": "text"}: free text (the default)."""

    type: Literal["text"]


class JsonObjectFormat(_Strict):
    """response_format {"type": "json_object"}: the reply is one JSON object (any keys)."""

    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    """OpenAI's json_schema: name, schema, strict. Its `description` (text OpenAI shows the model) is
    refused as an unknown field: lmforge does not put it in the prompt, and would otherwise ignore it."""

    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class JsonSchemaFormat(_Strict):
    """response_format {"type": "json_schema", "json_schema": {...}}: the reply is JSON valid against the
    schema (strict: a keyword the server cannot enforce is refused; otherwise it is not enforced)."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class RegexFormat(_Strict):
    """lmforge's extension (vLLM's guided_regex, SGLang's regex): {"type": "regex", "regex": PATTERN}, the
    whole reply matches PATTERN (Rust regex syntax)."""

    type: Literal["regex"]
    regex: StrictStr = Field(min_length=1, max_length=4096)


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat | RegexFormat,
                           Field(discriminator="type")]


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(16, ge=0)

    @model_validator(mode="after")
    def _prompts(self):
        lp = self.logprobs
        if not (lp is None or lp is False or (_is_int(lp) and 0 <= lp <= MAX_COMPLETION_LOGPROBS)):
            raise ValueError(f"'logprobs' takes an integer from 0 to {MAX_COMPLETION_LOGPROBS} (the most "
                             f"likely tokens to report at each position), got {json.dumps(lp, default=repr)}")
        if self.top_logprobs is not None:
            raise ValueError("'top_logprobs' is a chat completions field; on /v1/completions 'logprobs': k "
                             "reports the k most likely tokens")
        if self.echo is not None and not isinstance(self.echo, bool):
            raise ValueError(f"'echo' takes true or false, got {json.dumps(self.echo, default=repr)}")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("'max_tokens' must be >= 1 ('max_tokens': 0 is allowed only with 'echo': true, "
                             "to score the prompt)")
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise ValueError("'prompt' is an empty list")
            if len(self.prompt) > MAX_PROMPTS and not isinstance(self.prompt[0], int):
                raise ValueError(f"'prompt' holds at most {MAX_PROMPTS} prompts, got {len(self.prompt)}")
        if self.n * len(self.prompt_list()) > MAX_SEQUENCES:
            raise ValueError(f"prompts x n must be at most {MAX_SEQUENCES}")
        return self

    def logprobs_k(self) -> int | None:
        """The alternatives to report per token, or None for no logprobs."""
        return None if self.logprobs is None or self.logprobs is False else int(self.logprobs)

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts: strings or token id lists."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class CalledFunction(_Strict):
    name: StrictStr
    arguments: StrictStr  # the JSON text of an object, as OpenAI returns it


class ToolCall(_Strict):
    id: StrictStr = Field(max_length=MAX_TOOL_ID_CHARS)
    type: Literal["function"]
    function: CalledFunction

    @model_validator(mode="after")
    def _arguments(self):
        try:
            args = loads(self.function.arguments)
            ToolBudget().walk(args, "function.arguments")  # what every render of the conversation carries
        except BadJSON as e:
            raise ValueError(f"function.arguments is not JSON text ({e.why})") from None
        except BadTools as e:
            raise ValueError(str(e)) from None
        if not isinstance(args, dict):
            raise ValueError(f"function.arguments is the JSON text of a {type(args).__name__}; arguments are "
                             "an object")
        return self

    def as_template_call(self) -> dict[str, Any]:
        """The call as a chat template takes it: arguments decoded."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": loads(self.function.arguments)}}


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS)  # an assistant's
    tool_call_id: StrictStr | None = Field(None, max_length=MAX_TOOL_ID_CHARS)  # a tool result's
    # What the client sends back of an assistant message it got (the openai client's message object):
    # accepted at null only, as nothing here produces them.
    refusal: None = None
    function_call: None = None
    audio: None = None

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"'tool_calls' is only allowed on an assistant message, not role '{self.role}'")
        if self.role == "tool":
            if self.tool_call_id is None:
                raise ValueError("a message of role 'tool' needs 'tool_call_id', the id of the call it "
                                 "answers")
            if self.content is None:
                raise ValueError("a message of role 'tool' needs 'content', the call's result")
        elif self.tool_call_id is not None:
            raise ValueError(f"'tool_call_id' is only allowed on a message of role 'tool', not '{self.role}'")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionDef(_Strict):
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: StrictStr | None = Field(None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ChosenFunction


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _limits(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give 'max_tokens' or 'max_completion_tokens', not both")
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise ValueError(f"'logprobs' takes true or false, got {json.dumps(self.logprobs, default=repr)}")
        top = self.top_logprobs
        if top is not None:
            if not (_is_int(top) and 0 <= top <= MAX_TOP_LOGPROBS):
                raise ValueError(f"'top_logprobs' takes an integer from 0 to {MAX_TOP_LOGPROBS}, got "
                                 f"{json.dumps(top, default=repr)}")
            if self.logprobs is not True:
                raise ValueError("'top_logprobs' needs 'logprobs': true")
        if self.echo is not None and self.echo is not False:
            raise ValueError("'echo' is a /v1/completions field; chat completions do not echo the prompt")
        return self

    def logprobs_k(self) -> int | None:
        """The alternatives to report per token, or None for no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs is True else None

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in tools or ()]
        if len(set(names)) < len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"'tools' defines the function '{dup}' twice; names must be unique")
        budget = ToolBudget()  # the nesting and size of what every render of the conversation carries
        try:
            for i, t in enumerate(tools or ()):
                budget.walk(t.function.parameters, f"tools.{i}.function.parameters")
        except BadTools as e:
            raise ValueError(str(e)) from None
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice, info: ValidationInfo):
        names = [t.function.name for t in info.data.get("tools") or ()]
        if choice not in (None, "none") and not names:
            raise ValueError("'tool_choice' needs 'tools': give the functions the model may call")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"'tool_choice' names the function '{choice.function.name}', which is not one "
                             f"of 'tools' ({', '.join(names)})")
        return choice

    @field_validator("parallel_tool_calls")
    @classmethod
    def _parallel(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("tools"):
            raise ValueError("'parallel_tool_calls' needs 'tools'")
        return value

    def tool_mode(self) -> str | None:
        """None (no tools, or tool_choice "none": the request is answered as one without tools), "auto",
        "required" or "named"."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def tool_dicts(self) -> list[dict]:
        """The tools as the chat template takes them (fields left unset are left out)."""
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (OpenAI's 'developer' role is a system prompt).

        A tool call's arguments reach the template decoded (as vLLM passes them: templates such as Llama
        3.1's write `arguments | tojson`), an assistant message without content has no 'content' key
        (as transformers passes it), and a tool result carries its `name`: the one given, else the called
        function's where an earlier call has its id (templates that print it read it there)."""
        out: list[dict[str, Any]] = []
        called: dict[str, str] = {}
        for m in self.messages:
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
            if m.content is not None or not m.tool_calls:
                msg["content"] = m.text()
            if m.tool_calls:
                msg["tool_calls"] = [c.as_template_call() for c in m.tool_calls]
                called.update((c.id, c.function.name) for c in m.tool_calls)
            if m.role == "tool":
                msg["tool_call_id"] = m.tool_call_id
                name = m.name if m.name is not None else called.get(m.tool_call_id)
                if name is not None:
                    msg["name"] = name
            out.append(msg)
        return out


# -- responses ------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error",
               500: "server_error"}


def error_body(status: int, message: str, type: str | None = None, code: str | int | None = None,
               param: str | None = None) -> dict[str, dict[str, Any]]:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type or ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
