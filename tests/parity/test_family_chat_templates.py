"""Each family's chat-template shape renders through lmforge's template sandbox exactly as transformers'
apply_chat_template renders it, and lmforge's assistant spans (what SFT trains on) cover each reply and
nothing the user or system wrote. The templates are written for this test in the turn formats of the
families (not copied from any model repository); Qwen3's thinking and tool calls and Gemma's system
folding have files of their own (test_family_qwen3_chat_template.py, test_chat_tools.py,
test_family_gemma_olmo2.py)."""

from __future__ import annotations

import pytest

from lmforge.data.chat_template import ChatTemplate

transformers = pytest.importorskip("transformers")


def _turns(open_: str, close: str, gen: str, bos: bool = False) -> str:
    """A template: the BOS token (if `bos`), then per message open_ + content + close; the generation
    prompt."""
    head = "{{ bos_token }}" if bos else ""
    return (head + "{% for m in messages %}" + open_ + "{{ m['content'] }}" + close + "{% endfor %}"
            "{% if add_generation_prompt %}" + gen + "{% endif %}")


TEMPLATES = {
    # Phi-3 / Phi-4: <|role|>\n content <|end|>\n
    "phi3": _turns("{{ '<|' + m['role'] + '|>\\n' }}", "{{ '<|end|>\\n' }}", "{{ '<|assistant|>\\n' }}"),
    # OLMo 2: the BOS token first, <|role|>\n content, the EOS token after assistant turns
    "olmo2": _turns("{{ '<|' + m['role'] + '|>\\n' }}",
                    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}",
                    "{{ '<|assistant|>\\n' }}", bos=True),
    # Granite: <|start_of_role|>role<|end_of_role|> content <|end_of_text|>\n
    "granite": _turns("{{ '<|start_of_role|>' + m['role'] + '<|end_of_role|>' }}",
                      "{{ '<|end_of_text|>\\n' }}", "{{ '<|start_of_role|>assistant<|end_of_role|>' }}"),
    # SmolLM3: ChatML with a reasoning-mode system header
    "smollm3": ("{{ '<|im_start|>system\\n## Metadata\\n\\nReasoning Mode: /no_think\\n\\n<|im_end|>\\n' }}"
                + _turns("{{ '<|im_start|>' + m['role'] + '\\n' }}", "{{ '<|im_end|>\\n' }}",
                         "{{ '<|im_start|>assistant\\n' }}")),
    # DeepSeek-V3: the system text first, then <｜User｜> / <｜Assistant｜> with an end of sentence
    "deepseek_v3": ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
                    "{% elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
                    "{% else %}{{ '<｜Assistant｜>' + m['content'] + eos_token }}{% endif %}{% endfor %}"
                    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"),
    # gpt-oss (harmony): <|start|>role<|message|> content <|end|>; replies on the final channel
    "gpt_oss": ("{% for m in messages %}{% if m['role'] == 'assistant' %}"
                "{{ '<|start|>assistant<|channel|>final<|message|>' + m['content'] + '<|return|>' }}"
                "{% else %}{{ '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}"
                "{% endif %}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"),
}
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 4 * 6?"},
    {"role": "assistant", "content": "24"},
]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    from lmforge.data.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("tok")
    Tokenizer.train(["what is two plus three answer briefly " * 20], 300, 2).save(root / "tok.json")
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(root / "tok.json"), **SPECIALS)


@pytest.mark.parametrize("family", sorted(TEMPLATES))
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_renders_as_apply_chat_template(hf_tokenizer, family, generation_prompt):
    source = TEMPLATES[family]
    ours = ChatTemplate(source, SPECIALS, name=family)
    hf_tokenizer.chat_template = source
    messages = CONVERSATION[:4] if generation_prompt else CONVERSATION
    ref = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert ours.render(messages, add_generation_prompt=generation_prompt) == ref


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_assistant_spans_cover_each_reply_and_nothing_else(family):
    text, spans = ChatTemplate(TEMPLATES[family], SPECIALS, name=family).assistant_spans(CONVERSATION)
    assert len(spans) == 2
    trained = [text[a:b] for a, b in spans]
    for reply, span in zip(("5", "24"), trained):
        assert reply in span, (family, trained)
    for message in CONVERSATION:
        if message["role"] != "assistant":
            assert all(message["content"] not in span for span in trained), (family, trained)
