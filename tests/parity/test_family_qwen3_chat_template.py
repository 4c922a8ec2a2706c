"""Qwen3's chat template takes `enable_thinking`: sft.template_kwargs passes such keyword arguments to
every render, as transformers' apply_chat_template(**kwargs) does, for sft (through the prepared data),
generate --chat and serve (through chat_template_of), and refuses what cannot be a template variable."""

from __future__ import annotations

import json
import types

import pytest

from lmforge.cli import main
from lmforge.config import load_config
from lmforge.data.chat_template import ChatTemplate
from lmforge.data.sft import load_prepared_sft
from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import ConfigError
from lmforge.eval.open_run import chat_template_of

transformers = pytest.importorskip("transformers")

# Qwen3's shape: with thinking off, an assistant turn (the generation prompt too) opens with an empty
# think block; thinking is on when the variable is undefined (the default).
OFF = ("{% if enable_thinking is defined and enable_thinking is false %}"
       "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}")
THINKING = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}" + OFF
    + "{% endif %}{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}" + OFF + "{% endif %}"
    "{% if tag is defined %}{{ tag }}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    tok = Tokenizer.train(["what is two plus three think " * 20], 300, 2)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(root / "tok.json")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(root / "tok.json"), eos_token="<|im_end|>")
    hf.chat_template = THINKING
    return hf


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True},
                                    {"enable_thinking": False, "tag": "x"}], ids=str)
def test_renders_as_transformers_apply_chat_template_with_the_same_kwargs(hf_tokenizer, kwargs):
    ours = ChatTemplate(THINKING, {"eos_token": "<|im_end|>"}, variables=kwargs)
    ref = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
    assert ours.render(MESSAGES, add_generation_prompt=True) == ref
    assert ("<think>" in ref) == (kwargs.get("enable_thinking") is False)


def test_sft_prepares_with_the_kwargs_and_chat_template_of_honours_them(tmp_path, hf_tokenizer):
    from lmforge.data.sft import prepare_sft

    hf_tokenizer.save_pretrained(tmp_path / "model")
    chat = tmp_path / "chat.jsonl"
    record = {"messages": [*MESSAGES, {"role": "assistant", "content": "five"}]}
    chat.write_text("\n".join(json.dumps(record) for _ in range(4)) + "\n")
    common = [f"run.dir={tmp_path / 'run'}", f"data.tokenizer.path={tmp_path / 'model'}",
              f"sft.data=[{chat}]", "model.max_seq_len=64"]
    cfg = load_config(None, [*common, "sft.template_kwargs={enable_thinking: false}"])
    assert cfg.sft.template_kwargs == {"enable_thinking": False}
    prepared = prepare_sft(cfg, lambda _: None)
    assert prepared.template.render(MESSAGES, True).endswith("</think>\n\n")
    # The prepared dir keeps the variables (a resumed run renders as the first one did) ...
    assert load_prepared_sft(tmp_path / "run" / "data").template.variables == {"enable_thinking": False}
    # ... and other kwargs are other settings: the data is prepared again, not reused.
    said: list[str] = []
    other = prepare_sft(load_config(None, common), said.append, replace=True)
    assert other.template.variables == {} and any("preparing it again" in s for s in said)
    # generate --chat and serve: the run config's kwargs, also when given only at generation time.
    run = types.SimpleNamespace(template=other.template, cfg=cfg)
    assert chat_template_of(run).render(MESSAGES, True).endswith("</think>\n\n")
    thinking = types.SimpleNamespace(template=prepared.template, cfg=load_config(None, common))
    assert chat_template_of(thinking).render(MESSAGES, True).endswith("assistant\n")


@pytest.mark.parametrize("value,needle", [
    ("{enable_thinking: {a: 1}}", "'enable_thinking' is dict"),
    ("{enable_thinking: [1, 2]}", "'enable_thinking' is list"),
    ("{messages: 1}", "'messages', which cannot be a template variable"),
    ("{add_generation_prompt: true}", "add_generation_prompt"),
    ("{'not an identifier': 1}", "cannot be a template variable"),
    ("[enable_thinking]", "must be a mapping"),
])
def test_template_kwargs_that_are_no_simple_variables_are_refused(value, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [f"sft.template_kwargs={value}"])


def test_cli_refuses_bad_template_kwargs_in_one_line(tmp_path, capsys):
    code = main(["sft", "--set", f"run.dir={tmp_path / 'r'}", "--set", "sft.template_kwargs={a: {b: 1}}"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("lmforge sft: error:") and "Traceback" not in err
    assert "sft.template_kwargs" in err and "'a' is dict; a template variable here is a string" in err
    assert not (tmp_path / "r").exists()
