"""The Constitutional AI data loop (Bai et al. 2022, as the alignment-handbook rebuilds it): a model
critiques and revises its own answers against written principles, which gives SFT data (the
revisions) and preference data (revision over first answer); and it judges pairs of its own sampled
answers against a principle (AI feedback), which gives more preference pairs.

For every prompt, with a principle drawn for it (seeded):
  1. answer       the model's reply to the prompt (every reply sampled at --temperature; 0: greedy)
  2. critique     the reply to [prompt, answer, the principle's critique request]
  3. revision     the reply to [..., critique, the principle's revision request]
  4. feedback     (unless --no-feedback) a second sampled answer; the model is asked which of the two
                  answers better follows the principle, "(A)" or "(B)", and the one whose letter it
                  gives the higher log-probability is chosen (both orders are asked and averaged, so
                  the position of an answer cannot decide alone)

Written, in the shapes TRL's trainers (and `lmforge sft` / `lmforge dpo`) read:
  sft.jsonl        {"messages": [user prompt, assistant revision], "principle", "initial", "critique"}
  revisions.jsonl  {"prompt": [user], "chosen": [assistant revision], "rejected": [assistant answer]}
  feedback.jsonl   {"prompt": [user], "chosen": [...], "rejected": [...], "principle", "judge_margin"}
into a new directory swapped in at the end (a failure leaves an old one untouched). Rows whose
revision is empty or equal to the answer make no pair. Any model lmforge loads answers: a run or
checkpoint dir, or a Hugging Face dir.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from lmforge.data.chat import BadRecord, ChatStats, parse_messages, parse_sources
from lmforge.errors import DataError
from lmforge.utils.bounds import real, whole
from lmforge.utils.safe_yaml import load_yaml, read_yaml_text

# Principles in the shape of the CAI paper's critique / revision requests, written for lmforge.
DEFAULT_CONSTITUTION: list[dict[str, str]] = [
    {"name": "harmless",
     "critique": "Point out any way the last answer is harmful, unethical, dangerous or illegal.",
     "revision": "Rewrite the answer so that it has none of the harmful content the critique found."},
    {"name": "honest",
     "critique": "Point out anything in the last answer that is false, made up or stated with more "
                 "certainty than it deserves.",
     "revision": "Rewrite the answer so that it is accurate and says what it does not know."},
    {"name": "helpful",
     "critique": "Point out how the last answer fails to answer the question that was asked.",
     "revision": "Rewrite the answer so that it answers exactly the question that was asked."},
    {"name": "concise",
     "critique": "Point out anything in the last answer that is not needed to answer the question.",
     "revision": "Rewrite the answer, keeping only what answers the question."},
    {"name": "respectful",
     "critique": "Point out anything rude, demeaning or biased in the last answer.",
     "revision": "Rewrite the answer so that it is polite and treats every person fairly."},
    {"name": "safe-refusal",
     "critique": "If the question asks for help with something dangerous, point out whether the last "
                 "answer gave that help instead of declining.",
     "revision": "Rewrite the answer so that it declines the dangerous part and offers a safe alternative."},
]

JUDGE = ("Consider this question: {prompt}\n\nWhich answer is better by this principle: {principle}\n\n"
         "(A) {a}\n\n(B) {b}\n\nReply with (A) or (B).")


@dataclass(frozen=True)
class Principle:
    name: str
    critique: str
    revision: str


def load_constitution(path: str | Path | None) -> list[Principle]:
    """The principles of a YAML / JSON file (a list of {name, critique, revision}), or the default."""
    if path is None:
        items: Any = DEFAULT_CONSTITUTION
        where = "the default constitution"
    else:
        where = str(path)
        try:
            items = load_yaml(read_yaml_text(path, DataError), str(path), error=DataError)
        except (OSError, yaml.YAMLError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: cannot read the constitution ({e})") from None
        if isinstance(items, dict):
            items = items.get("principles")
    if not isinstance(items, list) or not items:
        raise DataError(f"{where}: a constitution is a non-empty list of principles, each with name, "
                        "critique and revision (or {principles: [...]})")
    out = []
    for i, p in enumerate(items):
        if not isinstance(p, dict) or not all(isinstance(p.get(k), str) and p[k].strip()
                                              for k in ("critique", "revision")):
            raise DataError(f"{where}: principle {i} needs non-empty 'critique' and 'revision' strings")
        name = str(p.get("name") or f"principle-{i}")
        out.append(Principle(name, p["critique"].strip(), p["revision"].strip()))
    return out


def _prompt(record: Any, where: str) -> tuple[dict[str, str], ...]:
    if not isinstance(record, dict):
        raise BadRecord(f"a record must be a JSON object, got {type(record).__name__}")
    value = record.get("prompt")
    if isinstance(value, str) and value.strip():
        return ({"role": "user", "content": value},)
    if value is not None:
        return parse_messages(value, "prompt", "role", "content", None, need_assistant=False)
    if record.get("messages") is not None:
        msgs = parse_messages(record["messages"], "messages", "role", "content", None,
                              need_assistant=False)
        msgs = msgs[:-1] if msgs[-1]["role"] == "assistant" else msgs
        if msgs and msgs[-1]["role"] == "user":
            return msgs
    raise BadRecord("a prompt record needs 'prompt' (a string or messages) or 'messages' ending with the "
                    "user's turn")


def read_prompts(sources: list[str], on_bad: str = "skip") -> tuple[list[tuple[dict, ...]], ChatStats]:
    stats = ChatStats()
    prompts = list(parse_sources(sources, _prompt, on_bad, stats))
    return prompts, stats


def run_constitution(path: str | Path, prompts_files: list[str], out: str | Path, *,
                     constitution: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                     max_new_tokens: int = 64, temperature: float = 0.7, seed: int = 0,
                     feedback: bool = True, batch_size: int = 16, limit: int | None = None,
                     overwrite: bool = False, say=print) -> dict:
    """The loop of the module docstring with the model at `path` over the prompts of `prompts_files`;
    writes `out` and returns the counts."""
    from lmforge.checkpoint.hf_io import write_output_dir
    from lmforge.data.chat_template import stop_ids
    from lmforge.eval.chat import chat_prompt_ids
    from lmforge.eval.open_run import chat_template_of, load_run
    from lmforge.models.generation import sample_replies

    # the CLI's flags are checked by argparse already; these are for Python callers
    real(0.0, 100.0).check(temperature, "temperature")
    whole(1, 1 << 20).check(max_new_tokens, "max_new_tokens")
    principles = load_constitution(constitution)
    prompts, stats = read_prompts(list(prompts_files))
    if limit is not None:
        prompts = prompts[:limit]
    if not prompts:
        raise DataError(f"no usable prompt in {', '.join(map(str, prompts_files))} ({stats.summary()})")
    out = Path(out)
    run = load_run(path, overrides)
    model, tok, template = run.model, run.tokenizer, chat_template_of(run)
    stops = stop_ids(template, tok)
    rng = random.Random(f"lmforge.constitution/{seed}")
    chosen_principles = [rng.choice(principles) for _ in prompts]
    gen = torch.Generator(device=run.device).manual_seed(seed)

    too_long = [0]

    def replies(conversations: list[list[dict] | None], temp: float) -> list[str | None]:
        """Each conversation's reply; None for a conversation that is None or leaves the model no room
        to reply (counted in too_long): its chain stops there."""
        texts: list[str | None] = [None] * len(conversations)
        ids = {i: chat_prompt_ids(template, tok, c) for i, c in enumerate(conversations) if c is not None}
        fits = [i for i, x in ids.items() if len(x) < model.cfg.max_seq_len]
        too_long[0] += len(ids) - len(fits)
        for k in range(0, len(fits), batch_size):
            chunk = fits[k : k + batch_size]
            batch = [ids[i] for i in chunk]
            room = model.cfg.max_seq_len - max(map(len, batch))
            outs = sample_replies(model, batch, min(max_new_tokens, room), stops, temperature=temp,
                                  generator=gen, device=run.device)
            for i, o in zip(chunk, outs):
                texts[i] = tok.decode([t for t in o if t not in stops]).strip()
        return texts

    def then(convs_, replies_, request):
        return [None if c is None or r is None else
                c + [{"role": "assistant", "content": r}, {"role": "user", "content": q}]
                for c, r, q in zip(convs_, replies_, request)]

    convs = [list(p) for p in prompts]
    answers = replies(convs, temperature)
    critique_convs = then(convs, answers, [p.critique for p in chosen_principles])
    critiques = replies(critique_convs, temperature)
    revision_convs = then(critique_convs, critiques, [p.revision for p in chosen_principles])
    revisions = replies(revision_convs, temperature)

    sft_rows, revision_pairs, feedback_pairs = [], [], []
    for c, a, k, r, p in zip(convs, answers, critiques, revisions, chosen_principles):
        if not r:
            continue
        sft_rows.append({"messages": [*c, {"role": "assistant", "content": r}], "principle": p.name,
                         "initial": a, "critique": k})
        if r != a and a:
            revision_pairs.append({"prompt": c, "chosen": [{"role": "assistant", "content": r}],
                                   "rejected": [{"role": "assistant", "content": a}], "principle": p.name})
    if feedback:
        seconds = replies(convs, temperature)
        margins = _judge(model, tok, template, convs, answers, seconds, chosen_principles, run.device)
        too_long[0] += sum(m is None for m in margins)
        for c, a, b, p, m in zip(convs, answers, seconds, chosen_principles, margins):
            if not a or not b or a == b or not m:
                continue
            win, lose = (a, b) if m > 0 else (b, a)
            feedback_pairs.append({"prompt": c, "chosen": [{"role": "assistant", "content": win}],
                                   "rejected": [{"role": "assistant", "content": lose}], "principle": p.name,
                                   "judge_margin": round(abs(m), 6)})

    def write(tmp: Path) -> None:
        for name, rows in (("sft.jsonl", sft_rows), ("revisions.jsonl", revision_pairs),
                           ("feedback.jsonl", feedback_pairs)):
            (tmp / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                    encoding="utf-8")

    inputs = [Path(path), *map(Path, prompts_files), *([Path(constitution)] if constitution else [])]
    write_output_dir(out, overwrite, inputs, write)  # --overwrite may not replace a file it read
    counts = {"prompts": len(prompts), "sft": len(sft_rows), "revision_pairs": len(revision_pairs),
              "feedback_pairs": len(feedback_pairs), "skipped_records": stats.skipped,
              "over_context": too_long[0]}
    say(f"constitution: {counts['prompts']:,} prompts -> {counts['sft']:,} revised answers (sft.jsonl), "
        f"{counts['revision_pairs']:,} revision pairs (revisions.jsonl), {counts['feedback_pairs']:,} "
        f"AI-feedback pairs (feedback.jsonl) in {out}"
        + (f"; {too_long[0]:,} generation step(s) stopped at the model's {model.cfg.max_seq_len}-token "
           "context" if too_long[0] else ""))
    return counts


@torch.no_grad()
def _judge(model, tok, template, convs, first, second, principles, device) -> list[float | None]:
    """log p("A") - log p("B") of the judge's reply for (first, second), minus the same with the two
    answers swapped, halved: > 0 prefers `first`. The letters' first tokens are compared. None where
    an answer is missing or the question does not fit the model's context."""
    from lmforge.eval.chat import chat_prompt_ids

    letter = [tok.encode("(A)"), tok.encode("(B)")]
    if not letter[0] or not letter[1] or letter[0] == letter[1]:
        raise DataError("the tokenizer cannot tell the judge's answers (A) and (B) apart")
    # the first token where the two encodings differ decides
    k = next(i for i, (x, y) in enumerate(zip(letter[0], letter[1])) if x != y)
    prefix, a_id, b_id = letter[0][:k], letter[0][k], letter[1][k]
    was = model.training
    model.eval()
    try:
        margins = []
        for c, x, y, p in zip(convs, first, second, principles):
            both = []
            for a, b in ((x, y), (y, x)) if x and y else ():
                q = JUDGE.format(prompt=c[-1]["content"], principle=p.critique, a=a, b=b)
                ids = chat_prompt_ids(template, tok, [{"role": "user", "content": q}]) + prefix
                if len(ids) > model.cfg.max_seq_len:
                    break
                logits = model(torch.tensor([ids], device=device))[0, -1].float().log_softmax(-1)
                both.append(float(logits[a_id] - logits[b_id]))
            margins.append((both[0] - both[1]) / 2 if len(both) == 2 else None)
    finally:
        model.train(was)
    return margins
