"""The arguments of each `lmforge` verb (cli/__init__.py holds the verbs themselves and `main`)."""

from __future__ import annotations

import argparse

from lmforge.cli.numbers import (
    BATCH,
    COUNT,
    FEWSHOT,
    LR,
    OPEN_FRACTION,
    PORT,
    POSITIVE,
    PREFIX_MB,
    RECORDS,
    SEED,
    SERVE_BATCH,
    SHARD_GB,
    TEMPERATURE,
    THREADS,
    TOKENS,
    WORLD,
    number,
    real,
    whole,
)
from lmforge.errors import LmforgeError

PROCS = whole(1, 1_000_000)  # the job server's process and thread bounds (api/limits.py: the same range)
PREFIX_CACHE_MB = 256  # serve's default prefix-cache budget (lmforge.serve.PREFIX_CACHE_MB: the same)
GIGABYTES = real(0.0, float(1 << 20), lo_open=True)  # memory in GiB: above 0, at most a petabyte

WEIGHTS = ("model", "ema", "swa")
WEIGHTS_HELP = "the trained weights (model) or their average kept during training (averaging.ema / .swa)"



def add_arguments(name: str, p: argparse.ArgumentParser) -> None:
    """Declare verb `name`'s arguments on its subparser `p`."""
    if name in ("import", "export", "merge"):
        p.add_argument("src", help="Hugging Face model dir" if name == "import" else
                       "run dir, checkpoint dir or imported model dir")
        p.add_argument("out", help="output dir (must be empty or missing)" if name != "export" else
                       "output dir (must be empty or missing), or with --format gguf the .gguf file to write")
        p.add_argument("--overwrite", action="store_true", help="replace a non-empty output dir")
        if name == "merge":
            p.add_argument("--weights", choices=WEIGHTS, default="model", help=WEIGHTS_HELP)
        if name == "export":
            p.add_argument("--adapter", action="store_true", help="a LoRA / DoRA / QLoRA run: write its "
                           "adapters in PEFT's format (out/adapter) and the base they need (out/base)")
            p.add_argument("--format", choices=("hf", "gguf"), default="hf",
                           help="hf: a Hugging Face model dir; gguf: one llama.cpp / Ollama file (out ends "
                           "in .gguf; an Ollama Modelfile is written beside it as OUT.Modelfile)")
            p.add_argument("--quant", choices=("f16", "q8_0", "q4_0", "q4_k_m"),
                           help="GGUF weight type (--format gguf only; default f16)")
            p.add_argument("--weights", choices=WEIGHTS, default="model", help=WEIGHTS_HELP)
            p.add_argument("--max-shard-gb", type=number(SHARD_GB), default=None,
                           help="split the weights into safetensors shards of at most this size (default 5; "
                           "--format hf only)")
        return
    if name == "prune":
        _prune_args(p)
        return
    if name == "quantize":
        _quantize_args(p)
        return
    if name == "scaling":
        _scaling_args(p)
        return
    if name == "server":
        _server_args(p)
        return
    p.add_argument("-c", "--config", help="YAML config file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.max_steps=100 (repeatable)")
    if name == "tasks":
        p.add_argument("-o", "--out", help="JSONL file to write (training records)")
        p.add_argument("--n", type=number(RECORDS), default=2000, help="records to write")
        p.add_argument("--seed", type=number(SEED), default=0, help="seed: the same seed writes the same "
                       "records")
        p.add_argument("--tasks", help="comma-separated task names (default: all but the safety data "
                       "refuse,benign, which come only when named; see --list)")
        p.add_argument("--difficulty", type=number(whole(1, 100)), default=1,
                       help="digits / lengths of the tasks (1: easiest; refuse / benign: framing 1-3)")
        p.add_argument("--system", help="a system prompt to put in every record")
        p.add_argument("--test-out", help="also write a held-out file whose prompts train never has")
        p.add_argument("--n-test", type=number(RECORDS), default=200, help="held-out records to aim for")
        p.add_argument("--unique", action="store_true", help="each prompt at most once (small task spaces: "
                       "fewer than --n records when the prompts run out)")
        p.add_argument("--exclude-prompts", action="append", default=[], metavar="FILE",
                       help="leave out every prompt of these records (JSONL / Parquet; repeatable): "
                       "prompt-disjoint SFT / RL / test sets of one small task space")
        p.add_argument("--overwrite", action="store_true", help="replace existing output files")
        p.add_argument("--list", action="store_true", help="print the task names and exit")
        p.add_argument("--unpaired", action="store_true", help="write KTO's unpaired records: each "
                       "pair's chosen answer (label true) and rejected answer (label false) apart")
        p.add_argument("--pairs", action="store_true", help="write preference pairs (prompt, chosen: the "
                       "answer, rejected: a wrong answer of the same task) for DPO-style training")
        return
    if name == "constitution":
        p.add_argument("path", nargs="?", help="the model: a run dir, checkpoint dir or Hugging Face dir")
        p.add_argument("--prompts", action="append", default=[], help="JSONL / Parquet prompts (prompt: "
                       "string or messages, or chat messages); repeatable")
        p.add_argument("-o", "--out", help="output dir: sft.jsonl, revisions.jsonl, feedback.jsonl")
        p.add_argument("--constitution", help="YAML / JSON principles (name, critique, revision); "
                       "default: lmforge's (see --write-default)")
        p.add_argument("--write-default", metavar="FILE", help="write the default constitution to FILE "
                       "(to edit) and exit")
        p.add_argument("--max-new-tokens", type=number(TOKENS), default=64, help="longest answer / critique")
        p.add_argument("--temperature", type=number(TEMPERATURE), default=0.7,
                       help="sampling temperature of answers")
        p.add_argument("--seed", type=number(SEED), default=0, help="seed of the principles drawn and the "
                       "samples")
        p.add_argument("--limit", type=number(COUNT), default=None, help="use the first N prompts only")
        p.add_argument("--no-feedback", action="store_true", help="skip the AI-feedback pairs")
        p.add_argument("--overwrite", action="store_true", help="replace a non-empty output dir (or the "
                       "existing FILE of --write-default)")
        return
    if name == "distill":
        p.add_argument("--precompute-topk", action="store_true", help="write distill.teacher's top-k "
                       "logits of every training and validation window to distill.topk_cache, and exit")
    if name in ("train", "sft", "dpo", "reward", "rl", "distill"):
        p.add_argument("--resume", action="store_true", help="continue the run in run.dir from its "
                       "latest checkpoint")
    if name == "data":
        p.add_argument("--overwrite", action="store_true", help="replace an output dir that holds a "
                       "run with different settings")
    if name in ("eval", "generate"):
        p.add_argument("--weights", choices=WEIGHTS, default="model", help=WEIGHTS_HELP)
    if name == "generate":
        p.add_argument("path", nargs="?", help="run dir or checkpoint dir (default: run.dir of -c)")
    if name == "eval":
        p.add_argument("path", nargs="*", help="run dir, checkpoint dir or Hugging Face dir (default: "
                       "run.dir of -c); with --tasks, several are compared side by side")
    if name == "generate":
        p.add_argument("--prompt", help="text to continue (same as --set generate.prompt=...)")
        p.add_argument("--chat", action="store_true", help="the prompt is a user message: render it with "
                       "the run's chat template and print the assistant's reply")
        p.add_argument("--draft", metavar="PATH", help="speculative decoding: a smaller run, checkpoint "
                       "or Hugging Face dir with the same tokenizer proposes tokens that the model "
                       "verifies (same output distribution; acceptance statistics on stderr)")
        p.add_argument("--draft-k", type=number(whole(1, 64)), default=4, metavar="K",
                       help="--draft: tokens proposed per "
                       "forward of the model")
        _quantized_args(p)
    if name == "eval":
        p.add_argument("--tasks", help="task evaluation instead of the loss: comma-separated task files "
                       "in lm-evaluation-harness's YAML format, dirs of them, or builtin:code (tasks "
                       "lmforge builds from installed packages' code); or one tasks JSONL (lmforge "
                       "tasks) for exact-match accuracy of greedy chat replies")
        p.add_argument("--data", help="perplexity, bits per byte, top-1/top-5 token accuracy and "
                       "calibration on this text (a .txt/.md/.jsonl/.parquet file or a dir of them), in "
                       "sliding windows, instead of the run's validation split")
        p.add_argument("--max-length", type=number(TOKENS), default=None, help="--data: tokens per window "
                       "(default: the model's max_seq_len)")
        p.add_argument("--stride", type=number(TOKENS), default=None,
                       help="--data: tokens the window moves by "
                       "(default: half of --max-length; equal to it: disjoint windows)")
        p.add_argument("--num-fewshot", type=number(FEWSHOT), default=None,
                       help="few-shot examples per prompt "
                       "(default: each task file's num_fewshot, else 0)")
        p.add_argument("--limit", type=number(POSITIVE), default=None, help="first N documents of each task "
                       "(a number below 1: that fraction): task files, a tasks JSONL (per task), --redteam "
                       "(prompts per category) and --data (documents)")
        p.add_argument("--batch-size", type=number(BATCH), default=None, help="sequences per forward "
                       "(default 16; 32 for a tasks JSONL and --redteam)")
        p.add_argument("--seed", type=number(SEED), default=None, help="seed of the few-shot draws "
                       "(default 1234)")
        p.add_argument("--chat", action="store_true", help="--tasks prompts as conversations rendered "
                       "with the run's chat template (a fine-tuned model)")
        p.add_argument("--fewshot-as-multiturn", action="store_true", help="with --chat: each few-shot "
                       "example its own user and assistant turn (default: one user message)")
        p.add_argument("--unsafe-code-exec", action="store_true", help="--tasks: run the model-written code "
                       "of pass@k tasks without the operating-system sandbox (bubblewrap), under the "
                       "in-process audit hook only, which is not a security boundary: only for code you "
                       "trust, on a machine without the sandbox")
        p.add_argument("--all-checkpoints", action="store_true", help="--tasks on every kept checkpoint "
                       "of the run: curves in eval_curves.md / eval_curves.png")
        p.add_argument("--no-contamination", action="store_true", help="skip the report of each task's "
                       "13-gram overlap with the run's training data")
        p.add_argument("--compare-out", default=None, help="with several runs: the comparison report "
                       "(default: eval_compare.md in the current dir)")
        p.add_argument("--overwrite", action="store_true", help="replace an existing --compare-out file")
        p.add_argument("--redteam", action="store_true", help="attack success rate per category of "
                       "greedy replies to lmforge's shipped red-team prompts (refusal, block-list and "
                       "PII detectors) and the refusal rate on harmless look-alikes, instead of the loss")
        p.add_argument("--redteam-prompts", help="a JSONL of {prompt, category} red-team records instead "
                       "of the shipped ones (implies --redteam); records with \"benign\": true are the "
                       "look-alikes (default: the shipped ones)")
    if name == "serve":
        p.add_argument("path", nargs="?", help="run dir, checkpoint dir or Hugging Face dir (default: "
                       "run.dir of -c)")
        p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine "
                       "only)")
        p.add_argument("--port", type=number(PORT), default=8000, help="TCP port to listen on")
        p.add_argument("--api-key", action="append", default=[], metavar="KEY", help="a key clients must "
                       "send as 'Authorization: Bearer KEY' (repeatable; default: $LMFORGE_API_KEY)")
        p.add_argument("--no-auth", action="store_true", help="serve without an API key")
        p.add_argument("--model-name", help="the model id clients ask for (default: the run's name)")
        p.add_argument("--max-batch-size", type=number(SERVE_BATCH), default=8,
                       help="sequences decoded together")
        p.add_argument("--prefix-cache-mb", type=number(PREFIX_MB), default=PREFIX_CACHE_MB, metavar="MB",
                       help="memory for the keys/values of prompt prefixes reused across requests (system "
                       f"prompts, chat history); 0 turns the prefix cache off (default {PREFIX_CACHE_MB})")
        p.add_argument("--threads", type=number(THREADS), default=None,
                       help="torch CPU threads (default: the cores "
                       "less one, at most 8)")
        p.add_argument("--weights", choices=WEIGHTS, default="model", help=WEIGHTS_HELP)
        p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", help="serve a LoRA/DoRA "
                       "adapter (an lmforge run dir or a PEFT adapter dir) as model NAME beside the base "
                       "(repeatable); requests for different adapters decode in one batch")
        p.add_argument("--max-adapters", type=number(whole(1, 1024)), default=8,
                       help="adapters held at once (default 8)")
        p.add_argument("--max-lora-rank", type=number(whole(1, 4096)), default=64,
                       help="the largest adapter rank accepted (default 64)")
        p.add_argument("--adapter-root", metavar="DIR", help="enable POST /v1/load_lora_adapter and "
                       "/v1/unload_lora_adapter, reading adapters only from under DIR (needs the admin key)")
        p.add_argument("--admin-key", metavar="KEY", help="the key of the adapter admin routes (default: "
                       "$LMFORGE_ADMIN_KEY); they accept it instead of an API key")
        _quantized_args(p)
    if name == "sweep":
        p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="a config key and "
                       "its values (repeatable; the grid is every combination); KEY=LOW..HIGH is a range "
                       "for --random (log-uniform for lr keys)")
        p.add_argument("--random", type=number(COUNT), default=None, metavar="K",
                       help="random search: K points "
                       "drawn from the --grid values and ranges instead of the full grid")
        p.add_argument("--seed", type=number(SEED), default=0, help="seed of the random search")
        p.add_argument("--parallel", type=number(whole(1, 1024)), default=1,
                       help="runs at a time (CPU threads are shared out)")
        p.add_argument("--backend", default="local", choices=("local", "ray"), help="subprocesses here, "
                       "or Ray tasks (pip install 'lmforge[ray]')")
        p.add_argument("--out", help="the sweep dir: one run dir per point, their logs and sweep.json; "
                       "run the same command again to resume (finished points are skipped)")
    if name == "plot-schedule":
        p.add_argument("-o", "--out", default="schedule.png",
                       help="PNG to write (default: schedule.png in the current dir; the run dir is "
                       "never created)")
        p.add_argument("--overwrite", action="store_true", help="replace an existing PNG")
        p.add_argument("--world-size", type=number(WORLD), default=1,
                       help="data-parallel ranks the run will use: they set the tokens per step")
    if name == "estimate":
        p.add_argument("--world-size", type=number(whole(1, 2**20)), default=1, help="processes the run "
                       "will use (parallel.* lays them out as at a real start)")
        p.add_argument("--device", default=None, help="judge against this device: cpu (available RAM) or "
                       "cuda / cuda:N (its total memory); default cpu")
        p.add_argument("--device-memory", type=number(GIGABYTES), default=None, metavar="GiB",
                       help="judge against this many GiB per rank instead of a device here")
        p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    if name == "lr-find":
        p.add_argument("--min-lr", type=number(LR), default=1e-7, help="first lr of the sweep")
        p.add_argument("--max-lr", type=number(LR), default=1.0, help="last lr of the sweep")
        p.add_argument("--steps", type=number(whole(5, 100_000)), default=100,
                       help="optimizer steps of the sweep")
        p.add_argument("-o", "--out", default="lr_find.png",
                       help="PNG to write (default: lr_find.png in the current dir; the run dir is "
                       "never created)")
        p.add_argument("--overwrite", action="store_true", help="replace an existing PNG")


def _prune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="run dir or checkpoint dir (a causal_lm run)")
    p.add_argument("out", help="output run dir (must be empty or missing)")
    p.add_argument("--method", required=True, choices=("magnitude", "2:4", "heads", "channels"),
                   help="magnitude: unstructured; 2:4: 2 of every 4 weights along the input dim; heads / "
                   "channels: remove whole attention heads (kv groups) / MLP channels, a smaller dense model")
    p.add_argument("--sparsity", type=number(OPEN_FRACTION),
                   help="magnitude: fraction of the weights zeroed, in [0, 1)")
    p.add_argument("--scope", default="layer", choices=("layer", "global"),
                   help="magnitude: rank the weights per matrix (layer) or all together (global)")
    p.add_argument("--heads", type=number(COUNT),
                   help="heads: query heads removed per layer (a multiple of the GQA "
                   "group size)")
    p.add_argument("--channels", type=number(COUNT), help="channels: MLP hidden channels removed per layer")
    p.add_argument("--ratio", type=number(OPEN_FRACTION),
                   help="heads / channels: the fraction removed instead of a count")
    p.add_argument("--score", default="magnitude", choices=("magnitude", "wanda"),
                   help="importance: weight magnitude, or Wanda's |W| * ||X|| on calibration text")
    p.add_argument("--calib", help="--score wanda: calibration text (.txt/.md/.jsonl/.parquet file or a "
                   "folder; default: the run's train split)")
    p.add_argument("--include-head", action="store_true", help="magnitude / 2:4: prune the output "
                   "projection too (the embedding table when tied)")
    p.add_argument("--recover-steps", type=number(whole(0, 10**9)), default=0,
                   help="steps of causal-LM training on the run's "
                   "data after pruning (sparsity kept)")
    p.add_argument("-c", "--config", help="recovery config: YAML sections (train:, optim:, schedule:...) "
                   "over the source run's config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recovery config key, e.g. --set optim.lr=3e-4 (repeatable)")
    p.add_argument("--weights", choices=WEIGHTS, default="model", help=WEIGHTS_HELP)
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output dir")


def _quantize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="run dir, checkpoint dir or Hugging Face dir")
    p.add_argument("out", help="output run dir (must be empty or missing)")
    p.add_argument("--bits", type=number(whole(1, 64)), default=4, help="4 or 8 bits per weight (default 4)")
    p.add_argument("--group-size", type=number(whole(0, 1 << 20)), default=None,
                   help="weights per scale along the inputs (default "
                   "128 for int4; int8 is per output channel unless given; 0: per-channel)")
    p.add_argument("--asymmetric", action="store_true", help="a zero point per group as well as a scale")
    p.add_argument("--method", default="rtn", help="rtn (round to nearest) or gptq (calibrated)")
    p.add_argument("--calib", help="calibration text: .txt/.md/.jsonl/.parquet file or folder (default: the "
                   "run's validation shards)")
    p.add_argument("--calib-samples", type=number(whole(1, 100_000)), default=128,
                   help="calibration sequences (default 128)")
    p.add_argument("--calib-seq-len", type=number(TOKENS), default=256,
                   help="tokens per calibration sequence "
                   "(default 256, at most model.max_seq_len)")
    p.add_argument("--act-order", action="store_true", help="gptq: quantize columns by decreasing "
                   "activation energy (group parameters fixed beforehand)")
    p.add_argument("--quantize-head", action="store_true", help="quantize an untied output head too")
    p.add_argument("--quantize-embeddings", action="store_true", help="quantize the token embedding table "
                   "too (round to nearest; a tied output head then reads it)")
    p.add_argument("--keep-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="dtype of the weights kept in floating point (embeddings, norms)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output dir")


def _scaling_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    plan = sub.add_parser("plan", help="compute-optimal N, D, predicted loss and a config realising them")
    what = plan.add_mutually_exclusive_group(required=True)
    what.add_argument("--compute", type=number(POSITIVE), help="training FLOPs (C = 6ND)")
    what.add_argument("--params", type=number(POSITIVE),
                      help="model size N: the tokens and compute it is optimal for")
    what.add_argument("--tokens", type=number(POSITIVE),
                      help="tokens D: the model size and compute they are optimal "
                      "for")
    plan.add_argument("--law", default="epoch", help="hoffmann (Hoffmann et al. 2022, approach 3), epoch "
                      "(Besiroglu et al. 2024's refit; default) or a fit file from `scaling fit --out`")
    plan.add_argument("-c", "--config", help="base config the planned one starts from (vocabulary, MLP, GQA, "
                      "context, data...)")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a base "
                      "config key (repeatable)")
    plan.add_argument("--out", help="write the planned config (YAML) here")
    plan.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    fit = sub.add_parser("fit", help="fit L(N, D) = E + A/N^alpha + B/D^beta to trained runs")
    fit.add_argument("runs", nargs="+", help="run dirs (trained to the end, with validation), sweep dirs "
                     "(lmforge sweep --out) or globs of them; what is not a run (logs, sweep.json) is "
                     "skipped and named, and so is a sweep's run that did not finish")
    fit.add_argument("--out", help="write the fit (JSON; `scaling plan --law FILE` reads it)")
    fit.add_argument("--plot", metavar="DIR", help="draw iso-loss contours and iso-FLOP curves into DIR")
    fit.add_argument("--overwrite", action="store_true", help="replace an existing --out file and the "
                     "plots in --plot DIR")
    fit.add_argument("--predict", action="append", default=[], metavar="N=..,D=..", help="predicted loss "
                     "at N parameters and D tokens (repeatable)")
    fit.add_argument("--predict-config", action="append", default=[], metavar="FILE", help="predicted loss "
                     "of the run a config describes (its N and train.max_steps' tokens; repeatable)")
    fit.add_argument("--check", action="append", default=[], metavar="RUN", help="a trained run left out "
                     "of the fit: its predicted and measured loss (repeatable)")
    fit.add_argument("--all-evals", action="store_true", help="every evaluation along each run as a point, "
                     "not only the final one (biased: the lr had not decayed yet)")
    fit.add_argument("--count", default="total", choices=("total", "non-embedding"), help="N with the "
                     "embedding table (Chinchilla's convention; default) or without (Kaplan's)")
    fit.add_argument("--bootstrap", type=number(whole(0, 1000)), default=50, metavar="K",
                     help="95%% confidence intervals "
                     "from K refits on resampled points (0: none)")
    fit.add_argument("--seed", type=number(SEED), default=0, help="seed of the bootstrap")


def _quantized_args(p: argparse.ArgumentParser) -> None:
    """serve's and generate's --quantized (the same CPU path gives the same tokens in both)."""
    p.add_argument("--quantized", choices=("int8", "int4", "auto"), default=None,
                   help="run weight-only quantized linear layers on the fastest CPU path that fits "
                   "--memory-budget-mb: a run from `lmforge quantize` keeps its integers (auto); a "
                   "full-precision run is quantized in memory (round to nearest; auto: int8)")
    p.add_argument("--quant-path", choices=("auto", "kernel-bf16", "kernel-fp32", "dequant-fp32",
                                            "dequant-bf16"), default="auto",
                   help="how --quantized layers run (default auto: a start-up probe of a few seconds "
                   "picks the fastest): torch's int kernels fed bf16 or fp32 activations, or the "
                   "weights dequantized once to fp32 or bf16 (fast, 4 or 2 bytes a weight)")
    p.add_argument("--memory-budget-mb", type=number(real(0.0, float(1 << 30), lo_open=True)),
                   default=None, metavar="MIB",
                   help="--quantized: the most MiB the weights may take (default: no limit)")


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workspace", help="the server's dir: server.db (jobs, token hashes) and jobs/<id>/")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=number(whole(1, 65535)), default=8080, help="TCP port to listen on")
    p.add_argument("--max-running", type=number(whole(1, 10_000)), default=1,
                   help="jobs running at once; the rest wait in a "
                   "first-in first-out queue")
    p.add_argument("--allow-root", action="append", default=[], metavar="PATH", help="a dir outside the "
                   "workspace that job configs may read from (data, init_from, teachers; repeatable)")
    p.add_argument("--jobs-per-minute", type=number(real(0.0, 1e6)), default=30.0,
                   help="job creations per user per minute "
                   "(token bucket; 0: unlimited)")
    p.add_argument("--job-burst", type=number(whole(1, 1_000_000)), default=10,
                   help="job creations per user allowed at once")
    p.add_argument("--max-procs-per-job", type=number(PROCS), default=None, metavar="N",
                   help="processes one job may "
                   "ask (nproc or its parallel layout; more: refused with 422; default: this machine's CPUs)")
    p.add_argument("--max-threads-per-job", type=number(PROCS), default=None, metavar="N", help="processes x "
                   "train.threads of one job (unset train.threads: the job gets its share of N; default: "
                   "this machine's CPUs)")
    p.add_argument("--max-memory-gb", type=number(GIGABYTES), default=None, metavar="GB",
                   help="memory one job may ask "
                   "(refused with 422 past it) and hold (stopped past it; default: --max-memory-gb-total)")
    p.add_argument("--max-procs", type=number(PROCS), default=None, metavar="N",
                   help="processes of all running "
                   "jobs together; a job waits until it fits (default: twice this machine's CPUs)")
    p.add_argument("--max-procs-per-user", type=number(PROCS), default=None, metavar="N",
                   help="processes of one "
                   "user's running jobs together; other users' jobs pass a waiting one (default: "
                   "--max-procs)")
    p.add_argument("--max-memory-gb-total", type=number(GIGABYTES), default=None, metavar="GB",
                   help="memory of all "
                   "running jobs together (default: 90%% of this machine's memory or its cgroup limit)")
    p.add_argument("--backend", default="local", choices=("local", "ray"), help="where jobs run: processes "
                   "on this machine, or Ray jobs on a cluster (pip install 'lmforge[ray]'); with ray the "
                   "workspace must be a filesystem every Ray node mounts at the same path, with lmforge "
                   "installed at the server's interpreter path")
    p.add_argument("--ray-address", default=None, metavar="URL", help="the Ray cluster's dashboard URL (its "
                   "Jobs API; default $RAY_ADDRESS, else http://127.0.0.1:8265)")
    p.add_argument("--ray-gpus-per-process", type=number(real(0.0, 1024.0)), default=0.0, metavar="G",
                   help="GPUs each job "
                   "process reserves on the Ray cluster (Ray then sets CUDA_VISIBLE_DEVICES; 0: CPU jobs)")
    p.add_argument("--publish-url", action="append", default=[], metavar="URL", help="a running `lmforge "
                   "serve` that POST /v1/jobs/ID/publish may load finished adapters into (repeatable; its "
                   "--adapter-root must contain this workspace's jobs/)")
    p.add_argument("--publish-key", metavar="KEY", help="the admin key of the --publish-url servers "
                   "(default: $LMFORGE_ADMIN_KEY)")
    sub = p.add_subparsers(dest="server_cmd", metavar="token")
    tok = sub.add_parser("token", help="create, list or revoke bearer tokens")
    acts = tok.add_subparsers(dest="token_action", required=True, metavar="ACTION")
    for action, text in (("create", "print a new token for --user (shown once; stored hashed)"),
                         ("list", "the tokens: id, user, active or revoked"),
                         ("revoke", "revoke a token by its id")):
        a = acts.add_parser(action, help=text, description=text)
        a.add_argument("--workspace", default=argparse.SUPPRESS, help="the server's workspace dir")
        if action == "create":
            a.add_argument("--user", required=True, help="the user the token acts as")
        if action == "revoke":
            a.add_argument("token_id", help="the token's id (or the whole token)")


# -- lmforge eval: which options each of its modes takes -------------------------------------------
EVAL_MODES = {
    "harness": "--tasks with task files",
    "jsonl": "--tasks with a tasks JSONL",
    "redteam": "--redteam",
    "data": "--data",
    "loss": "the validation loss (no --tasks, --data or --redteam)",
}
# dest -> (option, the modes that use it). An option given to a mode that does not use it is refused, so
# no one reads a number believing it was limited, seeded or batched as asked when it was not.
EVAL_OPTIONS = {
    "limit": ("--limit", ("harness", "jsonl", "redteam", "data")),
    "batch_size": ("--batch-size", ("harness", "jsonl", "redteam", "data")),
    "num_fewshot": ("--num-fewshot", ("harness",)),
    "seed": ("--seed", ("harness",)),
    "chat": ("--chat", ("harness", "jsonl", "redteam")),  # a tasks JSONL and the red team always chat
    "fewshot_as_multiturn": ("--fewshot-as-multiturn", ("harness",)),
    "all_checkpoints": ("--all-checkpoints", ("harness",)),
    "no_contamination": ("--no-contamination", ("harness",)),
    "compare_out": ("--compare-out", ("harness",)),
    "max_length": ("--max-length", ("data",)),
    "stride": ("--stride", ("data",)),
}
_LOSS_HINTS = {"limit": "; the validation loss reads eval.max_batches batches (--set eval.max_batches=N)",
               "batch_size": "; the validation loss batches by eval.batch_size (--set eval.batch_size=N)"}


def eval_mode(args: argparse.Namespace) -> str:
    """The mode of `lmforge eval` its arguments ask for (a key of EVAL_MODES), refusing a mix of modes
    and an option the mode does not use (LmforgeError naming the option and the modes that take it)."""
    asked = [m for m, on in (("redteam", args.redteam or args.redteam_prompts), ("data", args.data),
                             ("tasks", args.tasks)) if on]
    if len(asked) > 1:
        raise LmforgeError(f"{' and '.join('--' + m for m in asked)} are different evaluations; give one "
                         "of them per call")
    mode = asked[0] if asked else "loss"
    if mode == "tasks":
        mode = "jsonl" if args.tasks.lower().endswith(".jsonl") else "harness"
    for dest, (flag, modes) in EVAL_OPTIONS.items():
        value = getattr(args, dest)
        if value is not None and value is not False and mode not in modes:
            raise LmforgeError(f"{flag} does not apply to {EVAL_MODES[mode]}; it goes with "
                             f"{', '.join(EVAL_MODES[m] for m in modes)}"
                             + (_LOSS_HINTS.get(dest, "") if mode == "loss" else ""))
    return mode
