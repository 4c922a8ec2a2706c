"""A rating study's answers written by the server: each prompt sent as one user turn to the run of a
finished train job (its chat template; ChatML for a run that was not fine-tuned), greedy decoding, so
both runs answer under the same rule and the same study always gets the same answers.

The run dir was written by a job, so it is read the way any stranger's run is, and never in the server's
own process: a child `python -m lmforge.jobserver.rating_gen RUN IN OUT` loads it and generates, held to
the server's per-job bounds like a job (its threads, its resident memory watched and the child killed past
`--max-memory-gb`, first in line for the kernel's out-of-memory killer, a wall-clock limit). One study
generates at a time (a lock); the answers are bounded by `max_new_tokens` and the study's size limits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from lmforge.jobserver.launch import JOB_OOM_SCORE_ADJ
from lmforge.jobserver.procs import _memory
from lmforge.jobserver.rating import MAX_ANSWER_CHARS, RatingStore

_ONE_AT_A_TIME = threading.Lock()
SECONDS_PER_TOKEN = 1.0  # the wall-clock bound: start-up plus this per token asked for, per prompt
START_SECONDS = 120.0


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


def _bounded_child() -> None:  # between fork and exec: os only
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(JOB_OOM_SCORE_ADJ))
    except OSError:
        pass


def answers_in_child(run_dir: Path, prompts: list[str], max_new_tokens: int, max_memory: int,
                     threads: int, work: Path) -> list[str]:
    """`generate_answers` in a child process under the per-job bounds; RuntimeError saying why it failed."""
    inp, out = work / "in.json", work / "out.json"
    inp.write_text(json.dumps({"prompts": prompts, "max_new_tokens": max_new_tokens}))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    deadline = time.monotonic() + START_SECONDS + SECONDS_PER_TOKEN * max_new_tokens * len(prompts)
    with open(work / "stderr.log", "wb") as err:
        argv = [sys.executable, "-m", "lmforge.jobserver.rating_gen", str(run_dir), str(inp), str(out)]
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                 env=env, preexec_fn=_bounded_child, start_new_session=True)
        why = None
        while child.poll() is None:
            if _memory(str(child.pid)) > max_memory:
                why = f"it used more than the server's --max-memory-gb {max_memory / 2**30:g} per job"
            elif time.monotonic() > deadline:
                why = "it ran past its time limit"
            if why:
                child.kill()
                child.wait()
                raise RuntimeError(why)
            time.sleep(0.2)
    if child.returncode != 0:
        tail = (work / "stderr.log").read_bytes()[-2000:].decode("utf-8", "replace").strip().splitlines()
        raise RuntimeError(tail[-1] if tail else f"exit status {child.returncode}")
    answers = json.loads(out.read_text())
    if not (isinstance(answers, list) and len(answers) == len(prompts) and all(isinstance(a, str)
                                                                               for a in answers)):
        raise RuntimeError("the generating process wrote no answer list")
    return [a[:MAX_ANSWER_CHARS] for a in answers]


def fill_study(store: RatingStore, study_id: str, runs: dict[str, Path], prompts: list[str],
               max_new_tokens: int, max_memory: int, threads: int, scratch: Path) -> None:
    """Generate each side's answers into the study, then mark it ready (or failed, with the reason)."""
    with _ONE_AT_A_TIME:
        try:
            scratch.mkdir(parents=True, exist_ok=True)
            for side, run_dir in sorted(runs.items()):
                with tempfile.TemporaryDirectory(dir=scratch) as work:
                    answers = answers_in_child(run_dir, prompts, max_new_tokens, max_memory, threads,
                                               Path(work))
                store.set_answers(study_id, side, answers)
        except Exception as e:  # noqa: BLE001 -- the study says why; the server goes on
            store.set_status(study_id, "failed", f"generating the answers failed: {e}")
            return
        store.set_status(study_id, "ready")


def start_filling(store: RatingStore, study_id: str, runs: dict[str, Path], prompts: list[str],
                  max_new_tokens: int, max_memory: int, threads: int, scratch: Path) -> threading.Thread:
    args = (store, study_id, runs, prompts, max_new_tokens, max_memory, threads, scratch)
    t = threading.Thread(target=fill_study, args=args, name=f"rating-gen-{study_id}", daemon=True)
    t.start()
    return t


def main(argv: list[str]) -> int:
    """The child: RUN IN OUT -> OUT holds the answers (JSON list); exit 2 and one line for a bad run."""
    from lmforge.errors import LmforgeError
    from lmforge.utils.io import atomic_write_json

    run_dir, inp, out = argv
    spec = json.loads(Path(inp).read_text())
    try:
        answers = generate_answers(Path(run_dir), spec["prompts"], int(spec["max_new_tokens"]))
    except (LmforgeError, ValueError, OSError) as e:
        print(f"the run could not answer: {e}", file=sys.stderr)
        return 2
    atomic_write_json(Path(out), answers)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
