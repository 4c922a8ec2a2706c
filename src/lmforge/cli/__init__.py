"""`lmforge <verb>`: a table from verb to entry function, and the one place user errors are printed."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator

from lmforge.cli.args import add_arguments
from lmforge.errors import ConfigError, LmforgeDeprecationWarning, LmforgeError
from lmforge.utils.io import check_new_file


def _config(args: argparse.Namespace):
    from lmforge.config.load import load_config

    return load_config(args.config, args.set)


def cmd_prepare(args: argparse.Namespace) -> int:
    from lmforge.data import prepare

    cfg = _config(args)
    if cfg.objective.name in ("sft", "dpo", "reward", "rl"):  # chat data, the fine-tuned model's tokenizer
        from lmforge.checkpoint.runs import resolve_init_from
        from lmforge.data.sft import prepare_sft

        prepare_sft(resolve_init_from(cfg, derived=True))  # a run's own config.yaml states what it derived
        return 0
    prepare(cfg)
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from lmforge.data.curate import curate

    console = Console(highlight=False)
    say = lambda m: console.print(m, markup=False)
    summary = curate(_config(args), overwrite=args.overwrite, console=say)
    table = Table(title="lmforge data", show_header=True)
    table.add_column("step")
    table.add_column("removed", justify="right")
    for name, n in summary["removed"].items():
        table.add_row(name, f"{n:,}")
    table.add_row("documents in -> out", f"{summary['docs_in']:,} -> {summary['docs_out']:,}")
    if summary["bad_input"]:
        table.add_row("bad input skipped", f"{summary['bad_input']:,}")
    console.print(table)
    console.print(f"{len(summary['shards'])} shards in {summary['output_dir']}/data, "
                  f"{summary['docs_per_s']:,.0f} docs/s; report: {summary['report']}", markup=False)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from lmforge.train.trainer import train

    train(_config(args), resume=args.resume)
    return 0


def _train_objective(args: argparse.Namespace, name: str) -> int:
    """`lmforge train` with objective `name` (what the verb means), refusing a config naming another."""
    from lmforge.train.trainer import train

    cfg = _config(args)
    if "name" in cfg.objective.model_fields_set and cfg.objective.name != name:
        raise ConfigError(f"lmforge {args.verb} trains objective {name}, but the config sets objective.name="
                          f"{cfg.objective.name}; remove it or use lmforge train")
    train(cfg.model_copy(update={"objective": cfg.objective.model_copy(update={"name": name})}),
          resume=args.resume)
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    return _train_objective(args, "sft")


def cmd_dpo(args: argparse.Namespace) -> int:
    return _train_objective(args, "dpo")


def cmd_reward(args: argparse.Namespace) -> int:
    return _train_objective(args, "reward")


def cmd_rl(args: argparse.Namespace) -> int:
    return _train_objective(args, "rl")


def cmd_distill(args: argparse.Namespace) -> int:
    if args.precompute_topk:
        from lmforge.finetune.topk_cache import precompute_topk

        precompute_topk(_config(args))
        return 0
    return _train_objective(args, "distill")


def cmd_tasks(args: argparse.Namespace) -> int:
    from lmforge.data.instruct_tasks import (
        generate,
        pairs_of,
        prompts_in,
        select,
        split_disjoint,
        task_names,
        unpaired_of,
        write_jsonl,
    )

    if args.list:
        named_only = set(task_names(everything=True)) - set(task_names())
        print("\n".join(name + ("  (safety data; only when named)" if name in named_only else "")
                        for name in task_names(everything=True)))
        return 0
    for path in (args.out, args.test_out):
        if path:
            check_new_file(path, args.overwrite)  # both, before any record is made or written
    tasks = args.tasks.split(",") if args.tasks else None
    if args.pairs and args.unpaired:
        raise LmforgeError("give --pairs or --unpaired, not both")
    if args.unpaired:
        shape = lambda records: unpaired_of(pairs_of(records, args.seed))  # noqa: E731
    elif args.pairs:
        shape = lambda records: pairs_of(records, args.seed)  # noqa: E731
    else:
        shape = lambda records: records  # noqa: E731
    if args.test_out and (args.unique or args.exclude_prompts):
        raise LmforgeError("--test-out splits one stream; --unique / --exclude-prompts build prompt-disjoint "
                           "files one call at a time: give one or the other")
    if args.test_out:
        split = split_disjoint(tasks, args.n, args.n_test, args.seed, args.difficulty, args.system)
        n_train = write_jsonl(shape(split.train), args.out, overwrite=args.overwrite)
        n_test = write_jsonl(shape(split.test), args.test_out, overwrite=args.overwrite)
        print(f"wrote {n_train:,} training records to {args.out} and {n_test:,} held-out records to "
              f"{args.test_out} ({split.n_dropped:,} test prompts also in train were dropped)")
    elif args.unique or args.exclude_prompts:
        excluded = prompts_in(args.exclude_prompts)
        records = select(tasks, args.n, args.seed, args.difficulty, args.system, unique=args.unique,
                         exclude=excluded)
        n = write_jsonl(shape(records), args.out, overwrite=args.overwrite)
        note = f"; the task space had no more {'new ' if args.unique else ''}prompts" if n < args.n else ""
        print(f"wrote {n:,} records to {args.out} ({len(excluded):,} prompts excluded{note})")
    else:
        n = write_jsonl(shape(generate(tasks, args.n, args.seed, args.difficulty, args.system)), args.out,
                        overwrite=args.overwrite)
        print(f"wrote {n:,} records to {args.out}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from lmforge.cli.args import eval_mode
    from lmforge.eval.entry import eval_tasks, evaluate
    from lmforge.eval.tasks import check_limit

    mode = eval_mode(args)  # refuses an option the mode would not use
    check_limit(args.limit)
    if mode == "harness":
        return _eval_harness(args)  # the one mode that takes several runs
    if args.unsafe_code_exec:
        raise LmforgeError("--unsafe-code-exec applies to --tasks with task files (pass@k runs code); "
                           "this mode runs no model-written code")
    if len(args.path) > 1:
        raise LmforgeError("several runs are compared with --tasks only; give one run otherwise")
    args.path = args.path[0] if args.path else None
    if args.redteam or args.redteam_prompts:
        from rich.console import Console
        from rich.table import Table

        from lmforge.eval.entry import eval_redteam

        result = eval_redteam(_run_path(args), args.redteam_prompts, args.set, weights=args.weights,
                              limit=args.limit, batch_size=args.batch_size or 32)
        table = Table(title="red-team attack success (complied: answered, no refusal)", show_header=True)
        table.add_column("category", no_wrap=True)
        for col in ("prompts", "attack success", "refused", "no answer", "flagged harmful / PII",
                    "benign refused / no answer"):
            table.add_column(col, justify="right")
        benign = result["benign"]
        for cat, r in result["categories"].items():
            b = benign if cat == "all" else benign["categories"].get(cat)
            table.add_row(cat, str(r["prompts"]), f"{r['attack_success_rate']:.1%}",
                          f"{r['refusal_rate']:.1%}", f"{r['non_answer_rate']:.1%}",
                          f"{r['flagged_harmful']}/{r['flagged_pii']}",
                          f"{b['refused']}/{b['non_answers']} of {b['prompts']}" if b else "-")
        Console(highlight=False).print(table)
        print(f"benign refusal rate (over-refusal): {benign['refusal_rate']:.1%} of {benign['prompts']} "
              f"harmless look-alike prompts refused; {benign['non_answers']} got no answer at all")
        return 0
    if args.data:
        from lmforge.eval.entry import eval_data

        eval_data(_run_path(args), args.data, args.set, weights=args.weights, max_length=args.max_length,
                  stride=args.stride, batch_size=args.batch_size or 16, limit=args.limit)
        return 0
    if args.tasks:
        from rich.console import Console
        from rich.table import Table

        acc = eval_tasks(_run_path(args), args.tasks, args.set, weights=args.weights, limit=args.limit,
                         batch_size=args.batch_size or 32)
        first = "" if args.limit is None else f" (first {args.limit:g} records of each task)"
        table = Table(title=f"exact match on {args.tasks}{first}", show_header=True)
        table.add_column("task")
        for col in ("correct", "total", "accuracy"):
            table.add_column(col, justify="right")
        for task, (c, n) in acc.items():
            table.add_row(task, str(c), str(n), f"{c / n:.1%}")
        c, n = sum(c for c, _ in acc.values()), sum(n for _, n in acc.values())
        table.add_row("all", str(c), str(n), f"{c / n:.1%}")
        Console(highlight=False).print(table)
        return 0
    evaluate(_run_path(args), args.set, weights=args.weights)
    return 0


def _eval_harness(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from lmforge.eval.harness import comparison_rows, eval_harness

    items = [t.strip() for t in args.tasks.split(",") if t.strip()]
    paths = _eval_paths(args)
    if len(paths) > 1:  # the comparison report: refused now rather than after every evaluation
        args.compare_out = str(check_new_file(args.compare_out or "eval_compare.md", args.overwrite))
    outs = eval_harness(paths, items, args.set, weights=args.weights, num_fewshot=args.num_fewshot,
                        limit=args.limit, batch_size=args.batch_size or 16,
                        seed=1234 if args.seed is None else args.seed, chat=args.chat,
                        multiturn=args.fewshot_as_multiturn, all_checkpoints=args.all_checkpoints,
                        compare_out=args.compare_out, contamination=not args.no_contamination,
                        code_isolation="hook" if args.unsafe_code_exec else "os")
    console = Console(highlight=False)
    if len(outs) > 1:
        table = Table(title="runs side by side (eval_compare.md)", show_header=True)
        for col in ["task", "metric", *paths] + (["B - A", "z"] if len(outs) == 2 else []):
            table.add_column(str(col))
        for row in comparison_rows(outs):
            table.add_row(*row)
        console.print(table)
        return 0
    out = outs[0]
    table = Table(title=f"tasks at step {out['step']}", show_header=True)
    table.add_column("task")
    table.add_column("metric")
    for col in ("value", "± stderr", "chance"):
        table.add_column(col, justify="right")
    for name, r in out["tasks"].items():
        for k, v in r["metrics"].items():
            err, chance = r["stderr"].get(k), r["chance"].get(k)
            table.add_row(name, k, f"{v:.4f}", "" if err is None else f"{err:.4f}",
                          "" if chance is None else f"{chance:.4f}")
    console.print(table)
    return 0


def _eval_paths(args: argparse.Namespace) -> list[str]:
    if args.path:
        return list(args.path)
    args.path = None
    return [_run_path(args)]  # -c CONFIG: its run.dir


def cmd_generate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lmforge.eval.entry import generate_text

    overrides = list(args.set)
    if args.prompt is not None:
        # Quote through YAML so any prompt text survives as a string.
        import json

        overrides.append(f"generate.prompt={json.dumps(args.prompt, ensure_ascii=False)}")
    console = Console(highlight=False)
    from lmforge.serve.quantized import model_preparer

    prepare = model_preparer(args.quantized, args.quant_path, args.memory_budget_mb,
                             say=lambda line: print(line, file=sys.stderr))
    texts = generate_text(_run_path(args), overrides, weights=args.weights, chat=args.chat, draft=args.draft,
                          draft_k=args.draft_k, say=lambda line: print(line, file=sys.stderr),
                          prepare=prepare)
    for i, text in enumerate(texts):
        if i:
            console.rule()
        console.print(text, markup=False)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from lmforge.serve import serve

    serve(_run_path(args), host=args.host, port=args.port, api_keys=args.api_key, no_auth=args.no_auth,
          model_name=args.model_name, max_batch_size=args.max_batch_size, weights=args.weights,
          overrides=args.set, threads=args.threads, prefix_cache_mb=args.prefix_cache_mb, loras=args.lora,
          admin_key=args.admin_key, adapter_root=args.adapter_root, max_adapters=args.max_adapters,
          max_lora_rank=args.max_lora_rank, quantized=args.quantized, quant_path=args.quant_path,
          memory_budget_mb=args.memory_budget_mb)
    return 0


def cmd_constitution(args: argparse.Namespace) -> int:
    from lmforge.tools.constitution import load_constitution, run_constitution

    if args.write_default:
        from pathlib import Path

        import yaml

        from lmforge.utils.io import atomic_write_text

        check_new_file(args.write_default, args.overwrite)
        principles = [vars(p) for p in load_constitution(None)]
        atomic_write_text(Path(args.write_default), yaml.safe_dump(principles, sort_keys=False, width=100))
        print(f"wrote the default constitution ({len(principles)} principles) to {args.write_default}")
        return 0
    if not args.path or not args.prompts or not args.out:
        raise LmforgeError("give the model (a run, checkpoint or Hugging Face dir), --prompts FILE and "
                           "-o DIR")
    run_constitution(args.path, args.prompts, args.out, constitution=args.constitution, overrides=args.set,
                     max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                     feedback=not args.no_feedback, limit=args.limit, overwrite=args.overwrite)
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from lmforge.checkpoint.hf_io import import_hf

    import_hf(args.src, args.out, overwrite=args.overwrite)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from lmforge.finetune.export import export_adapter, export_run

    if args.format == "gguf":
        from lmforge.finetune.gguf import export_gguf

        if args.adapter:
            raise LmforgeError("--adapter writes a PEFT adapter dir; --format gguf writes the merged model "
                               "(give one or the other)")
        if args.max_shard_gb is not None:
            raise LmforgeError("--max-shard-gb applies to --format hf only (a GGUF export is one file)")
        export_gguf(args.src, args.out, quant=args.quant or "f16", overwrite=args.overwrite,
                    weights=args.weights)
        return 0
    if args.quant is not None:
        raise LmforgeError("--quant applies to --format gguf only (a Hugging Face export keeps the run's "
                           "dtype)")
    if args.adapter:
        export_adapter(args.src, args.out, overwrite=args.overwrite, weights=args.weights)
        return 0
    shard_gb = 5.0 if args.max_shard_gb is None else args.max_shard_gb
    export_run(args.src, args.out, overwrite=args.overwrite, max_shard_size=int(shard_gb * 2**30),
               weights=args.weights)
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    from lmforge.finetune.export import merge_run

    merge_run(args.src, args.out, overwrite=args.overwrite, weights=args.weights)
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    from lmforge.compress.prune import PruneSpec, prune_run

    spec = PruneSpec(method=args.method, sparsity=args.sparsity, scope=args.scope, heads=args.heads,
                     channels=args.channels, ratio=args.ratio, score=args.score, calib=args.calib,
                     include_head=args.include_head)
    prune_run(args.src, args.out, spec, recover_steps=args.recover_steps, recovery_config=args.config,
              overrides=args.set, overwrite=args.overwrite, weights=args.weights)
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from lmforge.compress.quantize import quantize_run

    group = args.group_size if args.group_size is not None else (None if args.bits == 8 else 128)
    quantize_run(args.src, args.out, bits=args.bits, group_size=group or None, symmetric=not args.asymmetric,
                 method=args.method, calib=args.calib, calib_samples=args.calib_samples,
                 calib_seq_len=args.calib_seq_len, overwrite=args.overwrite, head=args.quantize_head,
                 embeddings=args.quantize_embeddings,
                 act_order=args.act_order, keep_dtype=args.keep_dtype)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from lmforge.config.load import dump_config

    sys.stdout.write(dump_config(_config(args)))
    return 0


def cmd_plot_schedule(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lmforge.tools.plots import plot_schedule, schedule_curve

    cfg = _config(args)
    check_new_file(args.out, args.overwrite)  # before any work
    curve = schedule_curve(cfg, world_size=args.world_size)
    out = plot_schedule(curve, args.out, title=f"{cfg.run.name}: {cfg.schedule.name} schedule")
    console = Console(highlight=False)
    last = len(curve.lrs) - 1
    end = curve.warmup_end
    if curve.seconds is not None:  # unit time: the steps depend on the machine's speed
        at = curve.seconds
        console.print(f"schedule {cfg.schedule.name} over train.max_time={cfg.train.max_time:g}s of training",
                      markup=False)
        console.print(f"peak lr      {max(curve.lrs):.4e} at {at[curve.peak_step]:.1f}s", markup=False)
        warm = f"{at[end]:.1f}s" if end is not None else "not reached"
        console.print(f"warm-up end  {warm}", markup=False)
        console.print(f"final lr     {curve.lrs[last]:.4e} at {at[last]:.1f}s", markup=False)
        console.print(f"wrote {out}", markup=False)
        return 0
    console.print(f"schedule {cfg.schedule.name} in {cfg.schedule.unit}: {len(curve.lrs):,} steps, "
                  f"{curve.max_tokens:,} tokens", markup=False)
    console.print(f"peak lr      {max(curve.lrs):.4e} at step {curve.peak_step}", markup=False)
    console.print("warm-up end  " + (f"step {end} ({curve.tokens[end]:,} tokens seen)" if end is not None
                                     else "not reached within the run"), markup=False)
    console.print(f"final lr     {curve.lrs[last]:.4e} at step {last}", markup=False)
    console.print(f"wrote {out}", markup=False)
    return 0


def cmd_lr_find(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from lmforge.tools.lr_finder import lr_find

    console = Console(highlight=False)
    if args.out:
        check_new_file(args.out, args.overwrite)  # before a sweep of minutes
    result = lr_find(_config(args), args.min_lr, args.max_lr, args.steps, args.out,
                     say=lambda m: console.print(m, markup=False))
    table = Table(title="lmforge lr-find", show_header=True)
    table.add_column("suggestion")
    table.add_column("lr", justify="right")
    table.add_row("steepest descent", f"{result.steepest_lr:.2e}")
    table.add_row("minimum / 10", f"{result.min_lr_div10:.2e}")
    table.add_row("(loss minimum at)", f"{result.min_loss_lr:.2e}")
    console.print(table)
    stop = "diverged" if result.diverged else "ran to the end"
    console.print(f"{len(result.lrs)} of {args.steps} steps ({stop}); smoothed loss "
                  f"{result.smoothed[0]:.4f} -> {min(result.smoothed):.4f}; plot: {result.png}", markup=False)
    return 0


def cmd_scaling(args: argparse.Namespace) -> int:
    from lmforge.tools.scaling import run_fit, run_plan

    if args.action == "plan":
        run_plan(args.law, compute=args.compute, params=args.params, tokens=args.tokens, config=args.config,
                 overrides=args.set, out=args.out, overwrite=args.overwrite)
        return 0
    run_fit(args.runs, out=args.out, plot=args.plot, predict=args.predict,
            predict_config=args.predict_config, check=args.check, all_evals=args.all_evals, count=args.count,
            samples=args.bootstrap, seed=args.seed, overwrite=args.overwrite)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from lmforge.tools.sweep import sweep

    if not args.out:
        raise LmforgeError("give --out DIR: the sweep's runs and sweep.json go there")
    summary = sweep(args.config, args.set, args.grid, args.out, random_k=args.random, seed=args.seed,
                    parallel=args.parallel, backend=args.backend)
    failed = [r["name"] for r in summary["runs"] if r["status"] != "done"]
    print(f"{len(summary['runs']) - len(failed)} of {len(summary['runs'])} runs done; summary in "
          f"{args.out}/sweep.json" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from lmforge.tools.estimate_report import run_estimate

    return run_estimate(_config(args), args.world_size, args.device, args.device_memory, args.json)


def cmd_server(args: argparse.Namespace) -> int:
    from lmforge.api.server import serve_jobs, token_command

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


def _run_path(args: argparse.Namespace) -> str:
    if args.path:
        return args.path
    if args.config:
        return _config(args).run.dir
    raise LmforgeError("give a run dir or checkpoint dir (e.g. runs/demo), or -c CONFIG to use its run.dir")


VERBS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
    "prepare": (cmd_prepare, "read sources, train the tokenizer, write token shards"),
    "data": (cmd_data, "clean, filter, redact and deduplicate a corpus (the curate section)"),
    "train": (cmd_train, "pretrain a model (prepares data on first use)"),
    "dpo": (cmd_dpo, "preference optimisation on chosen/rejected pairs (objective dpo: DPO, IPO, SimPO, "
                     "ORPO, ... by preference.loss), full or with adapters"),
    "reward": (cmd_reward, "train a reward model on chosen/rejected pairs (objective reward: a scalar score "
                           "head, Bradley-Terry loss), full or with adapters"),
    "rl": (cmd_rl, "reinforcement learning on sampled completions scored by rewards (objective rl: GRPO "
                   "or RLOO by rl.algorithm), full or with adapters"),
    "sft": (cmd_sft, "fine-tune on chat data (objective sft): full, LoRA, DoRA or QLoRA (the finetune "
            "section)"),
    "distill": (cmd_distill, "knowledge distillation (objective distill): a student learns a teacher's "
                "next-token distributions (forward / reverse KL, generalised JSD) mixed with the data loss"),
    "constitution": (cmd_constitution, "Constitutional AI data: a model critiques and revises its answers "
                     "against principles (SFT data, revision pairs) and judges pairs of them (AI-feedback "
                     "pairs for DPO)"),
    "tasks": (cmd_tasks, "write verifiable instruction tasks (arithmetic, strings, recall...) as chat JSONL"),
    "eval": (cmd_eval, "validation loss, perplexity and bits per byte of a run or checkpoint"),
    "generate": (cmd_generate, "sample text from a run or checkpoint"),
    "serve": (cmd_serve, "an OpenAI-compatible HTTP server (completions, chat, streaming) for a run or "
                         "checkpoint"),
    "server": (cmd_server, "a REST job server: submit, watch (SSE), cancel, resume and download runs with "
               "bearer tokens (`server token create`); OpenAPI docs at /docs"),
    "import": (cmd_import, "convert a Hugging Face model dir (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3/4, "
               "OLMo 2, Granite, SmolLM3, GPT-2, DeepSeek-V3, gpt-oss, mixtures of experts, BERT) to an "
               "lmforge run"),
    "export": (cmd_export, "write a run, checkpoint or imported model as a Hugging Face model dir"),
    "merge": (cmd_merge, "fold a LoRA / DoRA / QLoRA run's adapters into its weights: a new run dir"),
    "prune": (cmd_prune, "prune a run (magnitude, 2:4, whole heads or MLP channels), optionally with a short "
                         "recovery fine-tune: a new run dir and prune_report.json"),
    "quantize": (cmd_quantize, "weight-only int8 / int4 quantization of a run (round-to-nearest or GPTQ): a "
                 "new run dir that eval / generate / export load"),
    "config": (cmd_config, "print the resolved config (defaults + file + --set)"),
    "plot-schedule": (cmd_plot_schedule, "draw the learning rate a run will use, step by step, to a PNG"),
    "estimate": (cmd_estimate, "memory a training run needs per rank (model states, activations, "
                 "temporaries, by layout and method: pretraining, SFT, LoRA / QLoRA, DPO, reward models), a "
                 "verdict against the device and settings that fit"),
    "lr-find": (cmd_lr_find, "learning-rate range test on a fresh model: loss against an exponential lr "
                "sweep, with suggested peak lrs"),
    "scaling": (cmd_scaling, "scaling laws: `plan` a compute-optimal model, tokens and config from a "
                "Chinchilla-form law; `fit` that law to trained runs, plot it and predict losses"),
    "sweep": (cmd_sweep, "one `lmforge train` per point of a grid or random search, each in its own run dir, "
              "with a resumable sweep.json"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmforge", description="From raw text to a trained language model.")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for name, (_, help_text) in VERBS.items():
        add_arguments(name, sub.add_parser(name, help=help_text, description=help_text))
    return parser


@contextlib.contextmanager
def _plain_warnings(verb: str, rank: int) -> Iterator[None]:
    """lmforge's own warnings (deprecated config keys) as one plain line each, from rank 0."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, LmforgeDeprecationWarning):
            return shown(message, category, filename, lineno, file, line)
        if rank == 0:
            print(f"lmforge {verb}: warning: {message}", file=sys.stderr)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse printed a usage error (a flag out of range, ...): exit 2 as any
        if e.code == 2:  # other user error, returned rather than raised so that callers see the status
            return 2
        raise  # --help and --version exit 0 as argparse does
    handler = VERBS[args.verb][0]
    rank = int(os.environ.get("RANK", "0"))
    try:
        with _plain_warnings(args.verb, rank):
            return handler(args)
    except LmforgeError as e:
        code = getattr(e, "exit_code", 2)
        # Under torchrun a config error is raised identically on every rank: rank 0 says it once.
        if rank == 0 or not isinstance(e, ConfigError):
            where = f"[rank {rank}] " if rank else ""
            print(f"{where}lmforge {args.verb}: error: {e}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print(f"lmforge {args.verb}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # the file system said no (read-only, permissions, full disk): not a bug
        where = f" {e.filename}" if e.filename else ""
        print(f"lmforge {args.verb}: error: cannot use{where}: {e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
