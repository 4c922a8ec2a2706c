"""`lmforge serve`'s request fields that it does not implement are accepted at their neutral values only:
a value that means "on" but compares equal to a neutral one in Python (0 == False, 1 == True) is refused
like any other, so no client reads an answer believing the option took effect. (logprobs, top_logprobs
and echo, logit_bias and the penalties work now: their refusals are in tests/unit/test_serve_logprobs.py and
tests/unit/test_serve_penalties.py.)"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from lmforge.serve.protocol import ChatCompletionRequest, CompletionRequest

COMPLETION = {"model": "tiny", "prompt": "x"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("model, base, field, value", [
    (CompletionRequest, COMPLETION, "best_of", True),  # True == 1
    (CompletionRequest, COMPLETION, "suffix", " end"),
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
    (ChatCompletionRequest, CHAT, "tool_choice", "none"),
    (ChatCompletionRequest, CHAT, "tools", []),
])
def test_neutral_values_still_pass(model, base, field, value):
    model.model_validate({**base, field: value})
