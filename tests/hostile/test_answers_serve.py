"""`lmforge serve`'s request fields that it does not implement are accepted at their neutral values only:
a value that means "on" but compares equal to a neutral one in Python (0 == False, 1 == True) is refused
like any other, so no client reads `logprobs: null` believing it asked for none."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from lmforge.serve.protocol import ChatCompletionRequest, CompletionRequest

COMPLETION = {"model": "tiny", "prompt": "x"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("model, base, field, value", [
    (CompletionRequest, COMPLETION, "logprobs", 0),  # completions: the chosen token's log-prob
    (CompletionRequest, COMPLETION, "logprobs", 0.0),
    (CompletionRequest, COMPLETION, "logprobs", 5),
    (CompletionRequest, COMPLETION, "logprobs", True),
    (ChatCompletionRequest, CHAT, "logprobs", True),
    (ChatCompletionRequest, CHAT, "logprobs", 0),
    (ChatCompletionRequest, CHAT, "logprobs", 1),
    (ChatCompletionRequest, CHAT, "top_logprobs", 0),  # any top_logprobs: lmforge returns none
    (ChatCompletionRequest, CHAT, "top_logprobs", False),
    (CompletionRequest, COMPLETION, "top_logprobs", 2),
    (CompletionRequest, COMPLETION, "echo", 1),  # 1 == True: echo on
    (CompletionRequest, COMPLETION, "echo", 0),  # a number where a boolean goes
    (CompletionRequest, COMPLETION, "best_of", True),  # True == 1
    (CompletionRequest, COMPLETION, "presence_penalty", False),  # False == 0
    (CompletionRequest, COMPLETION, "frequency_penalty", 0.5),
    (CompletionRequest, COMPLETION, "suffix", " end"),
    (CompletionRequest, COMPLETION, "logit_bias", {"1": 100}),
    (ChatCompletionRequest, CHAT, "response_format", {"type": "json_object"}),
    (ChatCompletionRequest, CHAT, "response_format", {"type": "text", "strict": True}),
])
def test_a_value_that_asks_for_an_unimplemented_feature_is_refused(model, base, field, value):
    with pytest.raises(ValidationError, match=f"'{field}' is not supported by lmforge serve"):
        model.model_validate({**base, field: value})


@pytest.mark.parametrize("model, base, field, value", [
    (CompletionRequest, COMPLETION, "logprobs", None),
    (CompletionRequest, COMPLETION, "logprobs", False),
    (ChatCompletionRequest, CHAT, "logprobs", False),
    (ChatCompletionRequest, CHAT, "top_logprobs", None),
    (CompletionRequest, COMPLETION, "echo", False),
    (CompletionRequest, COMPLETION, "best_of", 1),
    (CompletionRequest, COMPLETION, "presence_penalty", 0),
    (CompletionRequest, COMPLETION, "presence_penalty", 0.0),
    (CompletionRequest, COMPLETION, "frequency_penalty", None),
    (CompletionRequest, COMPLETION, "suffix", ""),
    (CompletionRequest, COMPLETION, "logit_bias", {}),
    (ChatCompletionRequest, CHAT, "response_format", {"type": "text"}),
    (ChatCompletionRequest, CHAT, "tool_choice", "none"),
    (ChatCompletionRequest, CHAT, "tools", []),
])
def test_neutral_values_still_pass(model, base, field, value):
    model.model_validate({**base, field: value})
