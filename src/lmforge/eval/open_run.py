"""`lmforge eval` and `lmforge generate`: open a trained run (or one checkpoint of it, or a Hugging Face
model dir), assembled for evaluation or sampling, and use it. (Until this release: eval/entry.py.)"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lmforge.assembly import Run, build_run
from lmforge.checkpoint.runs import run_config, run_tokenizer_file
from lmforge.config.methods import method_facts
from lmforge.config.t5 import refuse_t5
from lmforge.data.chat import ChatStats
from lmforge.data.chat_template import ChatTemplate, stop_ids, tokenizer_template
from lmforge.engine.evaluate import evaluate_loss
from lmforge.errors import DataError, LmforgeError
from lmforge.eval.chat import chat_prompt_ids, chat_prompts, task_accuracy
from lmforge.eval.generate import generate
from lmforge.utils.io import atomic_write_json


def load_run(path: str | Path, overrides: list[str] | tuple[str, ...] = (), weights: str = "model",
             encoder_decoder: bool = False) -> Run:
    """The model and tokenizer of a run dir, checkpoint dir or Hugging Face dir (`weights`: the
    trained ones, or their 'ema' / 'swa' average kept during training). An encoder-decoder (T5) only
    for a caller that says it handles one (`encoder_decoder`): the others run decoder models."""
    cfg, source = run_config(path, overrides)
    if not encoder_decoder:
        refuse_t5(cfg, "this command (it runs decoder models)")
    return build_run(cfg, "generate", weights_from=source, weights=weights)


def evaluate(path: str | Path, overrides: list[str] | tuple[str, ...] = (), say=print,
             weights: str = "model") -> dict[str, float]:
    """Loss, perplexity and bits per byte of a run's checkpoint on its validation (or train) split."""
    cfg, source = run_config(path, overrides)
    run = build_run(cfg, "eval", weights_from=source, weights=weights)
    out = evaluate_loss(run.model, run.val_loader.iter_eval_batches(run.eval_batches), run.objective,
                        precision=run.precision, token_bytes=run.token_bytes, device=run.device)
    result = {"step": run.step, "split": cfg.eval.split, "weights": weights, **out}
    suffix = "" if weights == "model" else f"_{weights}"
    written = run.run_dir / f"eval_{cfg.eval.split}_step_{run.step:08d}{suffix}.json"
    atomic_write_json(written, result)
    facts = method_facts(cfg)
    extra = "".join(f"  {k} {v:.4f}" for k, v in out.items() if k not in ("loss", "ppl", "tokens", "bpb"))
    ppl = f"  ppl {out['ppl']:.2f}" if facts.token_loss else ""  # perplexity: of token losses only
    say(f"{run.weights_from}{suffix} ({cfg.eval.split}, {out['tokens']:,} {facts.unit}): "
        f"loss {out['loss']:.4f}"
        + ppl + (f"  bpb {out['bpb']:.4f}" if "bpb" in out else "") + extra)
    say(f"results: {written}")
    return result


def eval_data(path: str | Path, data: str | Path, overrides: list[str] | tuple[str, ...] = (),
              weights: str = "model", max_length: int | None = None, stride: int | None = None,
              batch_size: int = 8, say=print, limit: float | None = None) -> dict:
    """Perplexity, bits per byte, top-1/top-5 token accuracy and next-token calibration of a run on
    any text (`lmforge eval data RUN --data FILE_OR_DIR`), in sliding windows of max_length tokens moved by
    `stride` (eval/perplexity.py); `limit`: the first N documents (or that fraction). Written to
    eval_data_<name>_step_N.json with a reliability diagram."""
    import re

    from lmforge.eval.metrics import reliability_diagram
    from lmforge.eval.perplexity import evaluate_perplexity

    run = load_run(path, overrides, weights)
    try:
        out = evaluate_perplexity(run.model, run.tokenizer, data, max_length=max_length, stride=stride,
                                  batch_size=batch_size, device=run.device, autocast=run.precision.autocast,
                                  limit=limit)
    except ValueError as e:
        if isinstance(e, LmforgeError):
            raise
        raise LmforgeError(f"--data {data}: {e}") from None
    confidence, correct = out.pop("confidence"), out.pop("correct")
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(data).name) or "data"
    suffix = "" if weights == "model" else f"_{weights}"
    stem = f"eval_data_{name}_step_{run.step:08d}{suffix}"
    result = {"step": run.step, "data": str(data), "weights": weights, "limit": limit, **out}
    atomic_write_json(run.run_dir / f"{stem}.json", result)
    reliability_diagram(confidence, correct, run.run_dir / f"{stem}_reliability.png",
                        f"next-token predictions on {name} (step {run.step})")
    say(f"{run.weights_from}{suffix} on {data} ({out['documents']:,} documents, {out['tokens']:,} tokens, "
        f"windows of {out['max_length']} by {out['stride']}): loss {out['loss']:.4f}  ppl {out['ppl']:.2f}  "
        f"bpb {out['bpb']:.4f}  top-1 {out['top1']:.2%}  top-5 {out['top5']:.2%}  ECE {out['ece']:.4f}")
    say(f"results: {run.run_dir / f'{stem}.json'} (reliability diagram {stem}_reliability.png)")
    return result


def generate_text(path: str | Path, overrides: list[str] | tuple[str, ...] = (),
                  weights: str = "model", chat: bool = False, draft: str | Path | None = None,
                  draft_k: int = 4, say=print, prepare=None) -> list[str]:
    """Continue `generate.prompt` with a run's checkpoint; returns prompt + continuation per sample.

    chat: the prompt is a user message, rendered by the run's chat template (ChatML for a run that
    was not fine-tuned), and each sample is the assistant's reply, up to its end of turn.
    draft: a run, checkpoint or Hugging Face dir with the same tokenizer: speculative decoding, the
    draft proposing `draft_k` tokens per forward of the model (same output distribution; greedy output
    identical); its acceptance statistics go to `say`. prepare: a function model -> model applied once
    loaded (`--quantized`: the CPU path `lmforge serve` runs, so that both give the same tokens)."""
    run = load_run(path, overrides, weights, encoder_decoder=True)
    g = run.cfg.generate
    if run.cfg.model.arch == "t5":
        from lmforge.models.t5_generate import check_text_options, text_to_text

        check_text_options(chat=chat, draft=draft, quantized=prepare is not None)
        return text_to_text(run.model, run.tokenizer, g.prompt, max_new_tokens=g.max_new_tokens,
                            temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                            num_samples=g.num_samples, seed=g.seed, device=run.device)
    if prepare is not None:
        run.model = prepare(run.model)
    if chat:
        template = chat_template_of(run)
        prompt_ids = chat_prompt_ids(template, run.tokenizer, [{"role": "user", "content": g.prompt}],
                                     run.model.cfg.max_seq_len)
        stops = stop_ids(template, run.tokenizer)
    else:
        prompt_ids = run.tokenizer.encode(g.prompt) if g.prompt else [run.tokenizer.eos_id]
        stops = {run.tokenizer.eos_id}
    if draft is not None:
        outs = _speculative_samples(run, draft, draft_k, prompt_ids, stops, say)
    else:
        outs = generate(run.model, prompt_ids, g.max_new_tokens, temperature=g.temperature, top_k=g.top_k,
                        top_p=g.top_p, num_samples=g.num_samples, seed=g.seed, eos_id=sorted(stops),
                        device=run.device)
    if chat:
        return [run.tokenizer.decode([t for t in ids if t not in stops]) for ids in outs]
    prefix = prompt_ids if g.prompt else []
    return [run.tokenizer.decode(prefix + ids) for ids in outs]


def _speculative_samples(run: Run, draft_path: str | Path, k: int, prompt_ids: list[int], stops: set[int],
                         say) -> list[list[int]]:
    """generate.num_samples continuations by speculative decoding with the draft model at draft_path
    (one after another from one generator seeded with generate.seed)."""
    import torch

    from lmforge.models.speculative import SpeculativeStats, speculative_generate

    draft = load_run(draft_path)
    if draft.tokenizer.hf.get_vocab() != run.tokenizer.hf.get_vocab():
        raise LmforgeError(f"--draft {draft_path}: its tokenizer differs from the one of {run.weights_from}; "
                           "a draft model must use the same tokenizer (e.g. trained on the same data dir)")
    g = run.cfg.generate
    gen = torch.Generator(device=run.device).manual_seed(g.seed)
    total, outs = SpeculativeStats(), []
    for _ in range(g.num_samples):
        out, stats = speculative_generate(run.model, draft.model.to(run.device), prompt_ids, g.max_new_tokens,
                                          k=k, temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                                          generator=gen, stops=frozenset(stops), device=run.device)
        outs.append(out)
        total.add(stats)
    say(total.summary())
    return outs


def chat_template_of(run: Run) -> ChatTemplate:
    """The template a run was fine-tuned with; for one that was not, the template its tokenizer ships
    with (a Hugging Face model dir's `chat_template` or chat_template.jinja, as transformers applies it),
    else lmforge's ChatML; rendered with the run config's sft.template_kwargs."""
    variables = run.cfg.sft.template_kwargs  # the run's, or a --set at generation time
    if run.template is not None:
        return run.template.with_variables(variables)
    own = tokenizer_template(run_tokenizer_file(run.cfg), run.tokenizer, variables)
    return own if own is not None else ChatTemplate.chatml(variables)


def eval_tasks(path: str | Path, tasks_file: str | Path, overrides: list[str] | tuple[str, ...] = (),
               weights: str = "model", max_new_tokens: int = 24, say=print, limit: float | None = None,
               batch_size: int = 32) -> dict[str, tuple[int, int]]:
    """Exact-match accuracy per task of a run's greedy replies to the records of `tasks_file` (JSONL
    as `lmforge tasks` writes: messages, task, answer; or its --pairs records, whose prompt is asked);
    `limit`: the first N records of each task (or that fraction), as --limit. Written to
    eval_tasks_step_N.json."""
    from lmforge.eval.tasks import first_of_each

    records = first_of_each(_task_records(Path(tasks_file)), "task", limit)  # bad input before the model
    run = load_run(path, overrides, weights, encoder_decoder=True)
    if run.cfg.model.arch == "t5":  # an encoder-decoder: the record's input text, no chat template
        from lmforge.eval.seq2seq import task_accuracy as seq2seq_accuracy

        acc = seq2seq_accuracy(run, records, max_new_tokens, batch_size)
    else:
        acc = task_accuracy(run.model, run.tokenizer, chat_template_of(run), records, max_new_tokens,
                            batch_size=batch_size, device=run.device)
    result = {"step": run.step, "tasks_file": str(tasks_file), "weights": weights, "limit": limit,
              "accuracy": {k: {"correct": c, "total": n, "accuracy": c / n} for k, (c, n) in acc.items()}}
    suffix = "" if weights == "model" else f"_{weights}"
    atomic_write_json(run.run_dir / f"eval_tasks_step_{run.step:08d}{suffix}.json", result)
    return acc


def eval_redteam(path: str | Path, prompts_file: str | Path | None = None,
                 overrides: list[str] | tuple[str, ...] = (), weights: str = "model",
                 max_new_tokens: int = 64, blocklist_files: Sequence[str] = (), limit: float | None = None,
                 batch_size: int = 32) -> dict[str, dict]:
    """Attack success rate per category of a run's greedy replies to red-team prompts (lmforge's
    shipped set, or a JSONL file of {"prompt", "category"}), with the detectors of eval/redteam.py,
    and the benign refusal rate (over-refusal) on harmless look-alikes: the file's records marked
    "benign": true, else lmforge's shipped ones; `limit`: the first N prompts of each category of either
    (or that fraction), as --limit. Returns {"categories": {category: rates}, "benign":
    over_refusal(...)}; written to eval_redteam_step_N.json with every prompt, reply and verdict."""
    from lmforge.eval.chat import greedy_replies
    from lmforge.eval.redteam import Detectors, attack_success, benign_records, over_refusal, shipped_records
    from lmforge.eval.tasks import first_of_each

    records = shipped_records() if prompts_file is None else _redteam_records(Path(prompts_file))
    attacks = first_of_each([r for r in records if not r.get("benign")], "category", limit)
    benign = first_of_each([r for r in records if r.get("benign")] or benign_records(), "category", limit)
    run = load_run(path, overrides, weights)
    template = chat_template_of(run)
    stops = stop_ids(template, run.tokenizer)
    ids = chat_prompts(template, run.tokenizer, [[{"role": "user", "content": r["prompt"]}]
                                                 for r in attacks + benign], run.model.cfg.max_seq_len)
    replies: list[str] = []
    for i in range(0, len(ids), batch_size):
        for out in greedy_replies(run.model, ids[i : i + batch_size], max_new_tokens, stops, run.device):
            replies.append(run.tokenizer.decode(out))
    detectors = Detectors(blocklist_files=blocklist_files)
    attack_replies, benign_replies = replies[: len(attacks)], replies[len(attacks) :]
    result = {"categories": attack_success(attacks, attack_replies, detectors),
              "benign": over_refusal(benign, benign_replies, detectors)}
    suffix = "" if weights == "model" else f"_{weights}"

    def details(rs: list[dict], texts: list[str]) -> list[dict]:
        return [{**r, "reply": reply, **vars(detectors(reply))} for r, reply in zip(rs, texts)]

    atomic_write_json(run.run_dir / f"eval_redteam_step_{run.step:08d}{suffix}.json",
                      {"step": run.step, "weights": weights, "prompts_file": None if prompts_file is None
                       else str(prompts_file), "limit": limit, **result,
                       "replies": details(attacks, attack_replies),
                       "benign_replies": details(benign, benign_replies)})
    return result


def _redteam_records(path: Path) -> list[dict]:
    from lmforge.data.chat import _iter_jsonl

    records = []
    for where, record in _iter_jsonl(path, ChatStats()):
        ok = isinstance(record, dict) and isinstance(record.get("prompt"), str) and record["prompt"].strip()
        if not (ok and isinstance(record.get("category"), str)):
            raise DataError(f"{where}: a red-team record needs string 'prompt' and 'category' keys")
        if not isinstance(record.get("benign", False), bool):
            raise DataError(f"{where}: 'benign' is {record['benign']!r}; give true (a harmless look-alike "
                            "whose refusal counts as over-refusal) or false / leave it out (an attack)")
        records.append(record)
    if not any(not r.get("benign") for r in records):
        raise DataError(f"{path} holds no red-team records (attacks: records without \"benign\": true)")
    return records


def _task_records(path: Path) -> list[dict]:
    """The records of a tasks JSONL file; a line that is not one is an error naming it."""
    from lmforge.data.chat import _iter_jsonl, to_conversation
    from lmforge.data.preference import to_pair

    if path.suffix.lower() != ".jsonl":
        raise DataError(f"{path}: a tasks file is JSONL (lmforge tasks writes one)")
    records = []
    for where, record in _iter_jsonl(path, ChatStats()):
        try:
            if isinstance(record, dict) and "chosen" in record:  # `lmforge tasks --pairs`: its prompt
                pair = to_pair(record, where)
                record = {**record, "messages": [*pair.prompt, *pair.chosen]}
            to_conversation(record, where, "messages")  # the same checks as training data
        except DataError as e:
            raise DataError(f"{where}: {e}") from None
        if not isinstance(record.get("task"), str) or not isinstance(record.get("answer"), str):
            raise DataError(f"{where}: a task record needs string 'task' and 'answer' keys")
        records.append(record)
    if not records:
        raise DataError(f"{path} holds no task records")
    return records
