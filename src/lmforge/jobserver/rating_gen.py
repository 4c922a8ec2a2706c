"""A rating study's answers written by the server: each prompt sent as one user turn to the run of a
finished train job (its chat template; ChatML for a run that was not fine-tuned), greedy decoding, so
both runs answer under the same rule and the same study always gets the same answers.

Generation runs in a thread of the server process, one study at a time (a lock), the model on CPU or
the device the run chose; the answers are bounded by `max_new_tokens` and the study's size limits.
"""

from __future__ import annotations

import threading
from pathlib import Path

from lmforge.jobserver.rating import MAX_ANSWER_CHARS, RatingStore

_ONE_AT_A_TIME = threading.Lock()


def generate_answers(run_dir: Path, prompts: list[str], max_new_tokens: int) -> list[str]:
    """The run's reply to each prompt (greedy, up to `max_new_tokens` tokens or its end of turn)."""
    from lmforge.data.chat_template import stop_ids
    from lmforge.eval.chat import chat_prompt_ids
    from lmforge.eval.generate import generate
    from lmforge.eval.open_run import chat_template_of, load_run

    run = load_run(run_dir)
    template = chat_template_of(run)
    stops = stop_ids(template, run.tokenizer)
    answers = []
    for p in prompts:
        ids = chat_prompt_ids(template, run.tokenizer, [{"role": "user", "content": p}],
                              run.model.cfg.max_seq_len - 1)
        out = generate(run.model, ids, max_new_tokens, temperature=0.0, eos_id=sorted(stops),
                       device=run.device)[0]
        answers.append(run.tokenizer.decode([t for t in out if t not in stops])[:MAX_ANSWER_CHARS])
    return answers


def fill_study(store: RatingStore, study_id: str, runs: dict[str, Path], prompts: list[str],
               max_new_tokens: int) -> None:
    """Generate each side's answers into the study, then mark it ready (or failed, with the reason)."""
    with _ONE_AT_A_TIME:
        try:
            for side, run_dir in sorted(runs.items()):
                store.set_answers(study_id, side, generate_answers(run_dir, prompts, max_new_tokens))
        except Exception as e:  # noqa: BLE001 -- the study says why; the server goes on
            store.set_status(study_id, "failed", f"generating the answers failed: {type(e).__name__}: {e}")
            return
        store.set_status(study_id, "ready")


def start_filling(store: RatingStore, study_id: str, runs: dict[str, Path], prompts: list[str],
                  max_new_tokens: int) -> threading.Thread:
    t = threading.Thread(target=fill_study, args=(store, study_id, runs, prompts, max_new_tokens),
                         name=f"rating-gen-{study_id}", daemon=True)
    t.start()
    return t
