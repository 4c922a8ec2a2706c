"""lmforge runs as a model of lm-evaluation-harness (`lm_eval`, 0.4.13+), registered as "lmforge":

    import lmforge.eval.lm_eval_model                      # registers the model with the harness
    lm_eval.simple_evaluate(model="lmforge", model_args="path=runs/demo,weights=ema", tasks=[...])

    python -m lmforge.eval.lm_eval_model --model lmforge --model_args path=runs/demo,batch_size=8 \\
        --tasks hellaswag                                  # lm_eval's own CLI, the model registered

lm_eval 0.4.13 finds models only in its registry (it reads no entry points), so its bare `lm_eval`
command cannot know "lmforge"; `python -m lmforge.eval.lm_eval_model ARGS` is that command with this
module imported first, and takes every argument and subcommand it takes.

model_args: path (a run dir, checkpoint dir or Hugging Face dir; required), weights (model / ema /
swa), batch_size, device (auto, cpu, cuda, cuda:N), precision (fp32 by default; bf16, fp16, auto),
max_length (the context, at most the model's max_seq_len) and seed (of sampled generations). A
batch_size or device in model_args wins over the harness's --batch_size / --device; the harness's
default device (cuda:0) on a machine without CUDA means the CPU, as it does for its own HF model.

Scores come from lmforge.eval.scorer, which follows the harness's `HFLM`: per-document numbers equal
those of `--model hf` on the exported model. Text is encoded as transformers encodes it: the text of
a special token (a chat template's `<|im_start|>`) is that token. Generation is greedy unless a task
asks for sampling (do_sample with a temperature > 0: drawn with temperature / top_k / top_p from a
generator seeded with `seed`, so a run repeats). With --apply_chat_template, prompts are rendered by
the run's chat template (lmforge's ChatML for a run that was not fine-tuned) and generation also stops
at the template's end of turn.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from lmforge.errors import LmforgeError

try:
    import lm_eval.models  # noqa: F401  (the harness's own models: an empty registry would skip them)
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import normalize_gen_kwargs
except ImportError as e:
    _message = (
        "lmforge's lm-evaluation-harness model needs the harness: pip install 'lm_eval>=0.4.13,<0.5' "
        f"({e})"
    )
    if __name__ == "__main__":
        print(f"lmforge lm_eval: error: {_message}", file=sys.stderr)
        sys.exit(2)
    raise LmforgeError(_message) from None

from tqdm import tqdm

log = logging.getLogger(__name__)

NAME = "lmforge"
CHUNK_BATCHES = 16  # batches per progress-bar step
GEN_KEYS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p"}
PRECISIONS = ("fp32", "bf16", "fp16", "auto")
NO_OP_GEN = {"num_beams": 1, "repetition_penalty": 1.0}  # accepted at the value that changes nothing


class LmforgeLM(TemplateLM):
    """An lmforge run (or checkpoint, or Hugging Face dir) answering the harness's requests."""

    def __init__(
        self,
        path: str | Path,
        weights: str = "model",
        batch_size: int | str = 16,
        device: str | None = None,
        precision: str = "fp32",
        max_length: int | None = None,
        seed: int = 1234,
        max_batch_size: int | None = None,  # the harness passes it; only meaningful for batch_size=auto
        **unknown,
    ) -> None:
        super().__init__()
        if unknown:
            raise LmforgeError(
                f"unknown lmforge model_args: {', '.join(sorted(unknown))}; valid: path, weights, "
                "batch_size, device, precision, max_length, seed"
            )
        from lmforge.engine.precision import Precision, resolve_precision
        from lmforge.eval.open_run import load_run
        from lmforge.eval.scorer import Scorer

        self._batch_size = _count("batch_size", batch_size)
        if str(precision) not in PRECISIONS:
            raise LmforgeError(f"precision={precision!r}: give one of {', '.join(PRECISIONS)}")
        overrides, move_to = _device_overrides(device)
        self.run = load_run(str(path), overrides, weights)
        if move_to is not None:
            self.run.model.to(move_to)
            self.run.device = move_to
        self._device = self.run.device
        self.path, self.weights = str(path), weights
        limit = self.run.cfg.model.max_seq_len
        self._max_length = limit if max_length is None else _count("max_length", max_length)
        if not 1 < self._max_length <= limit:
            raise LmforgeError(f"max_length={max_length}: give 2 .. {limit} (the model's max_seq_len)")
        name = resolve_precision(str(precision), self._device, self.run.model, self._batch_size,
                                 self._max_length, self.run.cfg.model.vocab_size, backward=False)
        self.precision = Precision(name, self._device)
        self.tokenizer = _HarnessTokenizer(self.run.tokenizer)
        self.scorer = Scorer(self.run.model, self.tokenizer, device=self._device, max_length=self._max_length,
                             batch_size=self._batch_size, autocast=self.precision.autocast)
        self.seed = int(seed)
        self._chat = False  # set once the harness renders a prompt with the chat template

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> LmforgeLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> LmforgeLM:
        """model_args win over the harness's --batch_size / --device (which it always passes: its
        defaults are batch size 1 on cuda:0)."""
        harness = {k: v for k, v in (additional_config or {}).items() if v is not None}
        args = dict(arg_dict)
        if "path" not in args:
            raise LmforgeError("the lmforge model needs model_args path=RUN_DIR (a run, checkpoint or "
                               "Hugging Face dir)")
        if "device" not in args and "device" in harness:
            args["device"] = _harness_device(str(harness.pop("device")))
        return cls(**{**harness, **args})

    # ------------------------------------------------------------------------------ the contract

    @property
    def eot_token_id(self) -> int:
        return self.run.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return 256

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return f"lmforge__{self.path.replace('/', '__')}__{self.weights}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens: Sequence[int], **kwargs) -> str:
        return self.tokenizer.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) or None, context ids, continuation ids)."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        step = self._batch_size * CHUNK_BATCHES
        with tqdm(total=len(order), desc="lmforge loglikelihood", disable=disable_tqdm) as bar:
            for start in range(0, len(order), step):
                idx = order[start : start + step]
                try:
                    scores = self.scorer.loglikelihood_tokens([(requests[i][1], requests[i][2]) for i in idx])
                except LmforgeError as e:
                    where = getattr(e, "index", None)
                    key = requests[idx[where]][0] if where is not None else None
                    raise LmforgeError(f"{e}" + (f" (request {_short(key)})" if key else "")) from None
                for i, res in zip(idx, scores):
                    out[i] = res
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], res)
                bar.update(len(idx))
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = [req.args[0] for req in requests]
        out = [0.0] * len(texts)  # an empty text has no tokens to score (the harness's 0)
        todo = [i for i, t in enumerate(texts) if self.tokenizer.encode(t)]
        step = self._batch_size * CHUNK_BATCHES
        with tqdm(total=len(texts), desc="lmforge loglikelihood_rolling", disable=disable_tqdm) as bar:
            bar.update(len(texts) - len(todo))
            for start in range(0, len(todo), step):
                idx = todo[start : start + step]
                for i, ll in zip(idx, self.scorer.rolling_loglikelihood([texts[i] for i in idx])):
                    out[i] = ll
                bar.update(len(idx))
        for text, ll in zip(texts, out):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), ll)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation, requests grouped by their generation settings."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out: list[str] = [""] * len(requests)
        with tqdm(total=len(requests), desc="lmforge generate_until", disable=disable_tqdm) as bar:
            for idx in groups.values():
                until, max_gen_toks, sampling = self._gen_settings(requests[idx[0]].args[1])
                idx = sorted(idx, key=lambda i: -len(requests[i].args[0]))
                step = self._batch_size * CHUNK_BATCHES
                for start in range(0, len(idx), step):
                    part = idx[start : start + step]
                    contexts = [requests[i].args[0] for i in part]
                    # sampled: each chunk its own seed, so no two chunks draw the same numbers
                    texts = self.scorer.generate_until(contexts, until, max_gen_toks,
                                                       seed=self.seed * 1_000_033 + start, **(sampling or {}))
                    for i, text in zip(part, texts):
                        out[i] = text
                        self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    bar.update(len(part))
        return out

    # ------------------------------------------------------------------------------ chat templates

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation rendered by the run's template; without a generation prompt, the last
        (assistant) message is left open for the model to continue (the harness's prefill)."""
        self._chat = True
        text = self._template().render(list(chat_history), add_generation_prompt=add_generation_prompt)
        if not add_generation_prompt and chat_history and chat_history[-1].get("content"):
            last = chat_history[-1]["content"]
            end = text.rfind(last)
            if end < 0:
                raise LmforgeError(f"{self._template().name} does not keep the last message as written: "
                                   "it cannot be continued (prefilled)")
            text = text[: end + len(last)]
        return text

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self._template().source if chat_template else None

    def get_model_info(self) -> dict:
        params = list(self.run.model.parameters())
        return {
            "model_num_parameters": sum(p.numel() for p in params),
            "model_dtype": str(params[0].dtype),
            "lmforge_weights": self.weights,
            "lmforge_weights_from": str(self.run.weights_from),
            "lmforge_step": self.run.step,
            "lmforge_precision": self.precision.name,
        }

    # ------------------------------------------------------------------------------ helpers

    def _template(self):
        from lmforge.eval.open_run import chat_template_of

        return chat_template_of(self.run)

    def _gen_settings(self, gen_kwargs: dict) -> tuple[list[str], int, dict | None]:
        """(stop strings, max new tokens, sampling settings or None for greedy) of a request."""
        if not isinstance(gen_kwargs, dict):
            raise LmforgeError(f"generate_until expects a dict of generation settings, got {gen_kwargs!r}")
        kw = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        if kw.pop("max_length", None) is not None:
            log.warning("max_length in generation settings is ignored; the lmforge model takes max_gen_toks")
        for key, value in NO_OP_GEN.items():
            if key in kw and kw.pop(key) != value:
                raise LmforgeError(f"the lmforge model does not support {key}={gen_kwargs[key]!r} "
                                   f"(only {value})")
        bad = sorted(set(kw) - GEN_KEYS)
        if bad:
            raise LmforgeError(f"the lmforge model does not support generation settings {bad}; "
                               f"supported: {sorted(GEN_KEYS)}")
        until = [kw["until"]] if isinstance(kw["until"], str) else list(kw["until"] or [])
        if self._chat:
            end = self._template().end_of_turn
            if end and end not in until:
                until.append(end)
        temperature = float(kw.get("temperature", 1.0))
        if not kw.get("do_sample") or temperature <= 0:
            return until, int(kw["max_gen_toks"]), None
        top_k = kw.get("top_k") or None  # 0 / None: no top-k, as in transformers
        top_p = kw.get("top_p")
        return until, int(kw["max_gen_toks"]), {
            "temperature": temperature,
            "top_k": None if top_k is None else int(top_k),
            "top_p": None if top_p is None else float(top_p),
        }


class _HarnessTokenizer:
    """lmforge's tokenizer encoding as transformers does for the harness: the text of a special
    token is that token (lmforge's own `encode` keeps it plain text)."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.eos_id = tokenizer.eos_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode_chat(text)[0]

    def decode(self, ids) -> str:
        return self._tok.decode(ids)

    def __getattr__(self, name: str):
        if name == "_tok":
            raise AttributeError(name)
        return getattr(self._tok, name)


def _count(key: str, value: int | str) -> int:
    """A model_arg that is a positive whole number."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        hint = " (the lmforge model has no batch_size=auto)" if key == "batch_size" else ""
        raise LmforgeError(f"{key}={value!r}: give a whole number{hint}") from None
    if n < 1 or n != value and str(n) != str(value).strip():
        raise LmforgeError(f"{key}={value!r}: give a whole number of at least 1")
    return n


def _device_overrides(device: str | None) -> tuple[list[str], torch.device | None]:
    """(config overrides that load the weights where asked, a device to move them to afterwards)."""
    name = "auto" if device is None else str(device).strip().lower()
    if name in ("auto", "cpu", "cuda"):
        return [f"train.device={name}"], None
    if name.startswith("cuda:") and name[5:].isdigit():
        if not torch.cuda.is_available():
            raise LmforgeError(f"device={device}: no CUDA device is available; use auto or cpu")
        if int(name[5:]) == 0:
            return ["train.device=cuda"], None
        return ["train.device=cpu"], torch.device(name)
    raise LmforgeError(f"device={device!r}: give auto, cpu, cuda or cuda:N")


def _harness_device(device: str) -> str:
    """The harness's --device (cuda:0 unless given): a CUDA device without CUDA means auto, as for HFLM."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        log.warning("device %s asked for, but no CUDA device is available: using the CPU", device)
        return "auto"
    return device


def _short(key) -> str:
    text = repr(key)
    return text if len(text) <= 200 else text[:200] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    """lm-evaluation-harness's CLI (`lm_eval ARGS`) with the "lmforge" model registered.

    The harness bootstraps some standard errors in a fork()ed multiprocessing pool, which can hang in a
    process that already runs torch's threads: unless the user set DISABLE_MULTIPROC, it is set here."""
    import os

    from lm_eval.__main__ import cli_evaluate

    os.environ.setdefault("DISABLE_MULTIPROC", "1")
    saved = sys.argv
    sys.argv = ["lm-eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        cli_evaluate()
    except LmforgeError as e:
        print(f"lmforge lm_eval: error: {e}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":  # `python -m`: register and run through the importable module (one class)
    from lmforge.eval.lm_eval_model import main as _main

    sys.exit(_main())
else:
    register_model(NAME)(LmforgeLM)
