"""SFT data against TRL: the assistant-only label mask of lmforge's chat rendering equals what TRL's
SFTTrainer builds (transformers' apply_chat_template with return_assistant_tokens_mask), and packed
batches equal TRL's padding-free packing (best-fit decreasing bins, restarting positions, labels)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from lmforge.data.batch import IGNORE_INDEX
from lmforge.data.chat import to_conversation
from lmforge.data.chat_loader import ChatLoader
from lmforge.data.chat_template import CHATML, CHATML_TOKENS, ChatTemplate
from lmforge.data.instruct_tasks import generate
from lmforge.data.sft import SFTSplit, label_mask
from lmforge.data.tokenizer import Tokenizer

pytest.importorskip("trl")
pytest.importorskip("datasets")

SEQ_LEN = 96


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    tmp = tmp_path_factory.mktemp("trl")
    records = generate(None, 60, seed=3, difficulty=2, system="Answer briefly.")
    rng = random.Random(0)
    convs = []
    for i, r in enumerate(records):  # multi-turn: some conversations get a second exchange
        msgs = list(r["messages"])
        if i % 3 == 0:
            extra = records[(i + 7) % len(records)]["messages"][-2:]
            msgs += extra
        if i % 5 == 0:
            msgs = msgs[1:]  # no system prompt
        convs.append(msgs)
    rng.shuffle(convs)
    text = " ".join(m["content"] for c in convs for m in c) * 3
    tok = Tokenizer.train([text, "<|endoftext|> assistant user system"], vocab_size=400, min_frequency=2)
    tok.add_special_tokens(CHATML_TOKENS)
    tok.save(tmp / "tokenizer.json")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_file=str(tmp / "tokenizer.json"), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    hf_tok.chat_template = CHATML
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=hf_tok.vocab_size,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    args = SFTConfig(
        output_dir=str(tmp / "out"),
        assistant_only_loss=True,
        packing=True,
        padding_free=True,
        max_length=SEQ_LEN,
        report_to=[],
        per_device_train_batch_size=4,
        use_cpu=True,
        bf16=False,
        dataset_num_proc=None,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list([{"messages": c} for c in convs]),
        processing_class=hf_tok,
    )
    ours = [
        label_mask(to_conversation({"messages": c}, f"conv {i}"), ChatTemplate.chatml(), tok, "assistant")
        for i, c in enumerate(convs)
    ]
    return convs, hf_tok, trainer, ours


def test_assistant_mask_equals_transformers_and_trl(setup):
    convs, hf_tok, _, ours = setup
    for conv, ex in zip(convs, ours):
        ref = hf_tok.apply_chat_template(
            conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert ex.ids.tolist() == list(ref["input_ids"])
        assert ex.mask.astype(int).tolist() == list(ref["assistant_masks"])
        assert ex.mask.sum() > 0


def test_packed_batches_equal_trl_padding_free(setup):
    _, _, trainer, ours = setup
    packed = trainer.train_dataset  # one row per best-fit-decreasing bin
    split = SFTSplit.of(ours)
    loader = ChatLoader(split, SEQ_LEN, 1, packing=True, shuffle=False, drop_last=False)
    assert len(loader.units) == len(packed)
    assert sum(len(r) > 1 for r in loader.units) >= 5  # real packing, not one conversation per row
    for k, row in enumerate(loader.units):
        ref_row = packed[k]
        ids = np.concatenate([split.example(i)[0] for i in row])
        assert ids.tolist() == ref_row["input_ids"], f"bin {k}"
        assert [int(split.lengths[i]) for i in row] == ref_row["seq_lengths"]
        # TRL's collator: positions restart, labels at each sequence's first position are -100, and the
        # model predicts labels[j + 1] at j. lmforge stores that shift in the targets.
        ref = trainer.data_collator([ref_row])
        batch = loader.collate([row])
        n = len(ids)
        assert batch.position_ids[0, :n].tolist() == ref["position_ids"][0].tolist()
        shifted = torch.cat([ref["labels"][0, 1:], torch.tensor([IGNORE_INDEX])])
        assert batch.targets[0, :n].tolist() == shifted.tolist()
        assert (batch.targets[0, n:] == IGNORE_INDEX).all() and (batch.segment_ids[0, n:] == -1).all()
        seq_starts = [0, *np.cumsum([int(split.lengths[i]) for i in row]).tolist()]
        assert ref["cu_seq_lens_q"].tolist() == seq_starts


def test_mask_without_generation_tags_adds_only_the_turn_separator(setup):
    """A template without {% generation %} is masked by rendering prefixes: the same tokens plus the
    newline ChatML writes after each <|im_end|> (it belongs to the assistant's turn there)."""
    convs, hf_tok, _, ours = setup
    plain = ChatTemplate(CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    tok = Tokenizer.of(hf_tok)
    for conv, ex in zip(convs[:20], ours[:20]):
        other = label_mask(to_conversation({"messages": conv}, "c"), plain, tok, "assistant")
        assert other.ids.tolist() == ex.ids.tolist()
        extra = np.flatnonzero(other.mask & ~ex.mask)
        assert (ex.mask & ~other.mask).sum() == 0
        assert [tok.decode([int(other.ids[i])]) for i in extra] == ["\n"] * sum(
            m["role"] == "assistant" for m in conv
        )
    json.dumps(convs[0])  # the conversations are plain JSON data
