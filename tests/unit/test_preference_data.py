"""Preference records in TRL's shapes -> pairs; unpaired (KTO) records; bad records skipped with
file:line or fatal; the shipped tasks' pairs (chosen scores 1, rejected 0)."""

from __future__ import annotations

import json

import pytest

from lmforge.data.chat import BadRecord, ChatStats
from lmforge.data.instruct_tasks import generate, generate_pairs, score, write_jsonl
from lmforge.data.preference import read_pairs, read_unpaired, to_pair, to_unpaired

U = {"role": "user", "content": "What is 2 + 2?"}
S = {"role": "system", "content": "Be brief."}
GOOD = {"role": "assistant", "content": "4"}
BAD = {"role": "assistant", "content": "5"}


def test_the_three_shapes_give_the_same_pair():
    standard = to_pair({"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"}, "f:1")
    explicit = to_pair({"prompt": [U], "chosen": [GOOD], "rejected": [BAD]}, "f:2")
    implicit = to_pair({"chosen": [U, GOOD], "rejected": [U, BAD]}, "f:3")
    for pair in (standard, explicit, implicit):
        assert (pair.prompt, pair.chosen, pair.rejected) == ((U,), (GOOD,), (BAD,))
    chosen, rejected = implicit.conversations()
    assert chosen.messages == (U, GOOD) and rejected.messages == (U, BAD)
    assert chosen.completion_start == rejected.completion_start == 1 and chosen.where == "f:3"


def test_implicit_prompt_is_the_longest_shared_run_of_messages():
    follow = {"role": "user", "content": "And 3 + 3?"}
    pair = to_pair({"chosen": [S, U, GOOD, follow, {"role": "assistant", "content": "6"}],
                    "rejected": [S, U, GOOD, follow, {"role": "assistant", "content": "7"}]}, "x")
    assert pair.prompt == (S, U, GOOD, follow) and pair.chosen[0]["content"] == "6"
    # multi-message completions are kept whole
    pair = to_pair({"prompt": [U], "chosen": [GOOD, {"role": "user", "content": "ok?"}, GOOD],
                    "rejected": [BAD]}, "x")
    assert len(pair.chosen) == 3


@pytest.mark.parametrize("record,why", [
    ({"prompt": "q", "chosen": "a"}, "needs 'chosen' and 'rejected'"),
    ({"prompt": "q", "chosen": "a", "rejected": "a"}, "the same completion"),
    ({"prompt": [U], "chosen": [GOOD, U], "rejected": [BAD]}, "ends with a user message"),
    ({"chosen": [U, GOOD], "rejected": [U, GOOD, U, BAD]}, "prefix of the other"),
    ({"chosen": "4", "rejected": "5"}, "no 'prompt'"),
    ({"prompt": [{"role": "robot", "content": "hi"}], "chosen": "a", "rejected": "b"}, "role 'robot'"),
    ({"prompt": "q", "chosen": [{"role": "assistant", "content": 4}], "rejected": "b"}, "not a string"),
    (["not", "an", "object"], "JSON object"),
])
def test_bad_pairs_say_what_is_wrong(record, why):
    with pytest.raises(BadRecord, match=why):
        to_pair(record, "f:1")


def test_unpaired_records():
    ex = to_unpaired({"prompt": "What is 2 + 2?", "completion": "4", "label": True}, "f:1")
    conv = ex.conversation()
    assert ex.desirable and conv.messages == (U, GOOD) and conv.completion_start == 1
    assert not to_unpaired({"prompt": [U], "completion": [BAD], "label": False}, "f:2").desirable
    with pytest.raises(BadRecord, match="'label'"):
        to_unpaired({"prompt": "q", "completion": "a", "label": "yes"}, "f:3")
    with pytest.raises(BadRecord, match="'prompt' and 'completion'"):
        to_unpaired({"prompt": "q", "label": True}, "f:4")


def test_reading_skips_bad_records_with_file_and_line(tmp_path):
    f = tmp_path / "pairs.jsonl"
    lines = [json.dumps({"prompt": "q1", "chosen": "a", "rejected": "b"}), "{not json",
             json.dumps({"prompt": "q2", "chosen": "a", "rejected": "a"}),
             json.dumps({"prompt": "q3", "chosen": "c", "rejected": "d"})]
    f.write_text("\n".join(lines) + "\n")
    stats = ChatStats()
    pairs = list(read_pairs([str(f)], stats=stats))
    assert [p.prompt[0]["content"] for p in pairs] == ["q1", "q3"]
    assert stats.records == 2 and stats.skipped == 2
    assert any(e.startswith(f"{f}:2") and "malformed JSON" in e for e in stats.examples)
    assert any(e.startswith(f"{f}:3") and "same completion" in e for e in stats.examples)
    with pytest.raises(BadRecord, match=r"pairs.jsonl:2: malformed JSON"):
        list(read_pairs([str(f)], on_bad="fail"))
    g = tmp_path / "kto.jsonl"
    g.write_text(json.dumps({"prompt": "q", "completion": "a", "label": False}) + "\n")
    assert [e.desirable for e in read_unpaired([str(g)])] == [False]


def test_shipped_task_pairs_contrast_a_right_and_a_wrong_answer(tmp_path):
    pairs = generate_pairs(None, 66, seed=5, difficulty=2)
    assert pairs == generate_pairs(None, 66, seed=5, difficulty=2)  # deterministic
    sft = generate(None, 66, seed=5, difficulty=2)
    assert {p["task"] for p in pairs} == {r["task"] for r in sft} and len({p["task"] for p in pairs}) == 11
    for p, r in zip(pairs, sft):
        assert p["prompt"] == r["messages"][:-1] and p["chosen"] == r["messages"][-1:]  # same prompts as SFT
        assert score(p["task"], p["answer"], p["chosen"][0]["content"])
        assert not score(p["task"], p["answer"], p["rejected"][0]["content"])
    path = tmp_path / "pairs.jsonl"
    write_jsonl(pairs, path)
    read = list(read_pairs([str(path)]))
    assert len(read) == 66 and read[0].chosen == tuple(pairs[0]["chosen"])


def test_cli_tasks_writes_pairs_and_held_out_pairs(tmp_path, capsys):
    from lmforge.cli import main

    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    assert main(["tasks", "--pairs", "--n", "44", "--n-test", "22", "--seed", "3", "-o", str(train),
                 "--test-out", str(test)]) == 0
    pairs, held_out = list(read_pairs([str(train)])), list(read_pairs([str(test)]))
    assert len(pairs) == 44 and 0 < len(held_out) <= 22
    prompts = {json.dumps(p.prompt) for p in pairs}
    assert not prompts & {json.dumps(p.prompt) for p in held_out}  # no held-out prompt in train
    rows = [json.loads(line) for line in test.read_text().splitlines()]
    assert all(not score(r["task"], r["answer"], r["rejected"][0]["content"]) for r in rows)
    # without --pairs the same command writes chat records
    assert main(["tasks", "--n", "5", "-o", str(tmp_path / "chat.jsonl")]) == 0
    assert "messages" in json.loads((tmp_path / "chat.jsonl").read_text().splitlines()[0])
