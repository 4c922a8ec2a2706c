"""Verbs that serve: `serve` (an OpenAI-compatible server for one model) and `jobs` (the REST job server
that trains, evaluates and exports on request, and its bearer tokens; `server` was its name until this
release, one letter from `serve`: lmforge.cli.verbs.RENAMED keeps it working for one more)."""

from __future__ import annotations

import argparse

from lmforge.cli.numbers import PORT, PREFIX_MB, SERVE_BATCH, THREADS, number, real, whole
from lmforge.cli.verbs.base import GIGABYTES, Verb, config_args, quantized_args, run_path, weights_arg

PROCS = whole(1, 1_000_000)  # the job server's process and thread bounds (jobserver/limits.py: same range)
PREFIX_CACHE_MB = 256  # serve's default prefix-cache budget (lmforge.serve.PREFIX_CACHE_MB: the same)


def _serve_args(p: argparse.ArgumentParser) -> None:
    config_args(p)
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
    weights_arg(p)
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
    quantized_args(p)


def _serve(args: argparse.Namespace) -> int:
    from lmforge.serve import serve

    serve(run_path(args), host=args.host, port=args.port, api_keys=args.api_key, no_auth=args.no_auth,
          model_name=args.model_name, max_batch_size=args.max_batch_size, weights=args.weights,
          overrides=args.set, threads=args.threads, prefix_cache_mb=args.prefix_cache_mb, loras=args.lora,
          admin_key=args.admin_key, adapter_root=args.adapter_root, max_adapters=args.max_adapters,
          max_lora_rank=args.max_lora_rank, quantized=args.quantized, quant_path=args.quant_path,
          memory_budget_mb=args.memory_budget_mb)
    return 0


def _jobs_args(p: argparse.ArgumentParser) -> None:
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


def _jobs(args: argparse.Namespace) -> int:
    from lmforge.jobserver.server import serve_jobs, token_command

    if args.server_cmd == "token":
        token_command(args.token_action, args.workspace, user=getattr(args, "user", None),
                      token_id=getattr(args, "token_id", None))
        return 0
    limits = {k: getattr(args, k) for k in ("max_procs_per_job", "max_threads_per_job", "max_procs",
                                            "max_procs_per_user")}
    limits.update(max_memory_gb=args.max_memory_gb, max_memory_gb_total=args.max_memory_gb_total)
    serve_jobs(args.workspace, host=args.host, port=args.port, max_running=args.max_running,
               allow_roots=args.allow_root, jobs_per_minute=args.jobs_per_minute, job_burst=args.job_burst,
               backend=args.backend, ray_address=args.ray_address, ray_gpus=args.ray_gpus_per_process,
               limits=limits, publish_urls=args.publish_url, publish_key=args.publish_key)
    return 0


SERVE = Verb("serve", "an OpenAI-compatible HTTP server (completions, chat, streaming) for a run or "
             "checkpoint", _serve_args, _serve)
JOBS = Verb("jobs", "a REST job server: submit, watch (SSE), cancel, resume and download runs with "
            "bearer tokens (`jobs token create`); OpenAPI docs at /docs", _jobs_args, _jobs)
