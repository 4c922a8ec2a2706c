"""Hostile chat templates and chat data, through the CLI: templates that loop, build huge values or run
C-level work past any budget (in sft, dpo, generate --chat and eval --chat alike), a Hugging Face dir's
own template (used, and refused when malformed), and chat files nested too deep, holding lone
surrogates, a byte order mark, a 21 MB message or 100,000 turns. Each ends in one clear error naming
the template's file, in seconds, or (for legitimate data) succeeds within the suite's memory limit."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from caselib import CHAT, SFT, Case, S, both, common, write

LOOP = ("{% for i in range(5000) %}{% for j in range(5000) %}{% for k in range(5000) %}"
        "{% endfor %}{% endfor %}{% endfor %}")
NESTED_RANGE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
DOUBLING = ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
            "{{ ns.s }}")
FORMAT_DOUBLING = (
    "{% set ns = namespace(f='%Y') %}{% for i in range(24) %}{% set ns.f = ns.f ~ ns.f %}{% endfor %}"
    "{{ strftime_now(ns.f) }}"
)
# Renders a conversation the way ChatML does, and hangs on a first message that says "hang".
CHATML_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PAIRS = '{"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"}\n' * 4


def bad_template(source: str) -> Callable[[Path], None]:
    return both(write("chat.jsonl", CHAT), write("bad.jinja", source))


def hf_template(value) -> Callable[[Path], None]:
    """The workspace's Hugging Face dir with `value` as its tokenizer_config.json's chat_template."""

    def setup(ws: Path) -> None:
        path = ws / "hf" / "tokenizer_config.json"
        config = json.loads(path.read_text())
        config["chat_template"] = value
        path.write_text(json.dumps(config))

    return setup


def DPO(*pairs: str) -> Callable[[Path], list[str]]:  # noqa: N802 - reads like SFT
    return lambda ws: [
        "dpo",
        *common(ws, "dpo"),
        "--set",
        f"model.init_from={json.dumps(str(ws / 'run'))}",
        "--set",
        f"preference.data={json.dumps([str(ws / 'pairs.jsonl')])}",
        "--set",
        "train.max_steps=1",
        "--set",
        "data.dir=null",
        *S(*(p.format(ws=json.dumps(str(ws))[1:-1]) for p in pairs)),
    ]


def generate_chat(ws: Path) -> list[str]:
    return ["generate", str(ws / "hf"), "--chat", "--prompt", "hi", "--set", "generate.max_new_tokens=2"]


def eval_chat(ws: Path) -> list[str]:
    return ["eval", str(ws / "hf"), "--tasks", str(ws / "t.yaml"), "--chat", "--no-contamination"]


def task_files(ws: Path) -> None:
    (ws / "t.jsonl").write_text('{"prompt": "Say hi", "answer": "hi"}\n')
    (ws / "t.yaml").write_text(
        f"task: t_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {ws / 't.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: prompt\ndoc_to_target: answer\n"
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 2\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )


def turns(n: int) -> str:
    messages = []
    for i in range(n // 2):
        messages += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    return json.dumps({"messages": messages}) + "\n" + CHAT * 4


def big_message(chars: int) -> str:
    reply = ("lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars]
    record = {"messages": [{"role": "user", "content": "write a lot"},
                           {"role": "assistant", "content": reply}]}
    return json.dumps(record) + "\n" + CHAT * 4


CASES: list[Case] = [
    # -- templates that work without end or build huge values -----------------------------------
    Case(
        "templates: sft, nested range(100000) loops",
        SFT("sft.template={ws}/bad.jinja"),
        bad_template(NESTED_RANGE),
        match="'range' would make 100,000 numbers",
    ),
    Case(
        "templates: sft, loops under the range limit that never end",
        SFT("sft.template={ws}/bad.jinja"),
        bad_template(LOOP),
        match="bad.jinja did not finish rendering a conversation within 2 s",
    ),
    Case(
        "templates: sft, a 10 GB string by '*'",
        SFT("sft.template={ws}/bad.jinja"),
        bad_template("{{ 'x' * 10000000000 }}"),
        match="repeating with '*' would make 10,000,000,000 characters",
    ),
    Case(
        "templates: sft, a string doubled with '~' until memory runs out",
        SFT("sft.template={ws}/bad.jinja"),
        bad_template(DOUBLING),
        match="and was stopped",
        subprocess=True,
    ),
    Case(
        "templates: sft, strftime_now with a 20-million-character format",
        SFT("sft.template={ws}/bad.jinja"),
        bad_template("{{ strftime_now('%Y' * 20000000) }}"),
        match="would make 40,000,000 characters",
    ),
    Case(
        "templates: sft, strftime_now with a format doubled by '~'",
        SFT("sft.template={ws}/bad.jinja"),
        bad_template(FORMAT_DOUBLING),
        match="a strftime_now format would make",
    ),
    Case(
        "templates: sft, a C-level format width",
        SFT("sft.template={ws}/bad.jinja"),
        bad_template("{{ '%99999999999s'|format('x') }}"),
        match="a format width would make 99,999,999,999 characters",
    ),
    Case(
        "templates: sft, a C-level ljust",
        SFT("sft.template={ws}/bad.jinja"),
        bad_template("{{ 'x'.ljust(10**10) }}"),
        match="'ljust' would make",
    ),
    Case(
        "templates: sft, a huge integer power",
        SFT("sft.template={ws}/bad.jinja"),
        bad_template("{{ 9 ** (9 ** 9) }}"),
        match="'**' would make",
    ),
    Case(
        "templates: sft, a template file that is not UTF-8",
        SFT("sft.template={ws}/bad.jinja"),
        both(write("chat.jsonl", CHAT), write("bad.jinja", b"{{ messages }}\xff\xfe")),
        match="not UTF-8",
    ),
    Case(
        "templates: dpo, a template that never ends",
        DPO("sft.template={ws}/bad.jinja"),
        both(write("pairs.jsonl", PAIRS), write("bad.jinja", LOOP)),
        match="bad.jinja did not finish rendering",
    ),
    # -- a Hugging Face dir's own template: generate --chat and eval --chat --------------------------
    Case(
        "templates: generate --chat renders with the HF dir's own template",
        generate_chat,
        hf_template("{{ raise_exception('rendered by the dir template') }}"),
        match="rendered by the dir template",
    ),
    Case(
        "templates: generate --chat, an HF template that never ends",
        generate_chat,
        hf_template(LOOP),
        match="tokenizer_config.json did not finish rendering",
    ),
    Case(
        "templates: generate --chat, an HF template building a huge string",
        generate_chat,
        hf_template("{{ 'ab' * 9999999999 }}"),
        match="tokenizer_config.json failed to render the conversation: repeating",
    ),
    Case(
        "templates: generate --chat, a chat_template list with a non-string template",
        generate_chat,
        hf_template([{"name": "default", "template": 5}]),
        match="entry 0",
    ),
    Case(
        "templates: generate --chat, a chat_template list without a default",
        generate_chat,
        hf_template([{"name": "tool_use", "template": CHATML_LIKE}]),
        match='no "default"',
    ),
    Case(
        "templates: generate --chat, a chat_template that is a number",
        generate_chat,
        hf_template(7),
        match="tokenizer_config.json must be a string or a list",
    ),
    Case(
        "templates: generate --chat, a tokenizer_config.json nested 100,000 deep",
        generate_chat,
        write("hf/tokenizer_config.json", "[" * 100_000 + "]" * 100_000),
        match="tokenizer_config.json: not valid JSON (JSON nested too deeply",
    ),
    Case(
        "templates: eval --chat with an HF template that never ends",
        eval_chat,
        both(hf_template(LOOP), task_files),
        match="tokenizer_config.json did not finish rendering",
    ),
    Case(
        "templates: eval --chat with an HF template using a C-level format width",
        eval_chat,
        both(hf_template("{{ '{:>99999999999}'.format('x') }}"), task_files),
        match="a format width would make",
    ),
    Case(
        "templates: generate with a prompt that is not UTF-8",
        lambda ws: ["generate", str(ws / "run"), "--chat", "--prompt", "a\udcffb"],
        match="lone surrogate",
    ),
    # -- chat data: byte order mark, deep nesting, lone surrogates, huge records ------------------
    Case(
        "templates: sft, chat JSONL with a UTF-8 byte order mark",
        SFT("sft.on_bad_record=fail", "train.micro_batch_size=1"),
        write("chat.jsonl", b"\xef\xbb\xbf" + CHAT.encode() * 4),
        expect=0,
    ),
    Case(
        "templates: sft, a JSONL line nested 100,000 deep",
        SFT("sft.on_bad_record=fail"),
        write("chat.jsonl", "[" * 100_000 + "]" * 100_000 + "\n" + CHAT),
        match="chat.jsonl:1: JSON nested too deeply",
    ),
    Case(
        "templates: sft, a message holding a lone surrogate",
        SFT("sft.on_bad_record=fail"),
        write("chat.jsonl", CHAT + '{"messages": [{"role": "user", "content": "a\\ud800b"}, '
              '{"role": "assistant", "content": "c"}]}\n'),
        match="chat.jsonl:3: messages.0.content holds a lone surrogate",
    ),
    Case(
        "templates: sft, a conversation of 100,000 turns",
        SFT("train.micro_batch_size=1"),
        write("chat.jsonl", turns(100_000)),
        expect=0,
        subprocess=True,
    ),
    Case(
        "templates: sft, one 21 MB message",
        SFT("train.micro_batch_size=1"),
        write("chat.jsonl", big_message(21_000_000)),
        expect=0,
        subprocess=True,
    ),
]
