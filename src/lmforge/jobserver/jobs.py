"""Turning a request into a job: parse and validate the config (the CLI's schema and messages), confine its
paths, choose the command and process count, and the job's public JSON shape.

Kinds: `train` runs `lmforge train` on the submitted config (any objective); `eval`, `generate` and
`export` run on an earlier train job of the same user (`source`) that has a checkpoint. Their `set`
overrides may touch the eval.* / generate.* sections only: everything else about the run is fixed
by its own config.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lmforge.config.load import (
    _key_lines,
    check_nesting,
    config_from_dict,
    parse_override,
    parse_yaml_text,
    save_config,
)
from lmforge.errors import ConfigError, LmforgeError
from lmforge.jobserver.confine import ConfinementError, Confiner, check_job_id
from lmforge.jobserver.limits import GIB, PROCESS_BASE_BYTES, Ask, Limits, OverAsk, memory_floor
from lmforge.jobserver.progress import Progress, eta_seconds
from lmforge.jobserver.store import RESUMABLE, Job

KINDS = ("train", "eval", "generate", "export")
MAX_SETS = 200
MAX_STEPS = 10**15
_NAME_RE = re.compile(r"^[\w .:+-]{1,128}$")


class RequestError(LmforgeError):
    """A request the server refuses: HTTP `status`, a message, and the `param` at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def new_job_id() -> str:
    return f"job-{secrets.token_hex(8)}"


@dataclass
class Request:
    """A parsed job request."""

    kind: str
    config: dict[str, Any] | None
    lines: dict[tuple[str, ...], int]
    sets: list[str]
    name: str | None
    source: str | None
    prompt: str | None
    nproc: int | None


def _load_yaml(text: str) -> Any:
    """A config sent as YAML text, or 422 naming the line: bad syntax, aliases, tags (!!python/...),
    values yaml cannot build, nesting too deep."""
    # An alias can expand a small document into a huge one (billion laughs); configs never need them.
    try:
        check_nesting(text, "config")  # first: deep nesting makes yaml's scanner slow
        for ev in yaml.parse(text):
            if isinstance(ev, yaml.AliasEvent):
                raise RequestError(422, f"config:{ev.start_mark.line + 1}: YAML anchors and aliases (*name) "
                                   "are not accepted here", "config", "invalid_config")
        return parse_yaml_text(text, "config")
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"config:{mark.line + 1}" if mark else "config"
        raise RequestError(422, f"{where}: invalid YAML: {getattr(e, 'problem', None) or e}", "config",
                           "invalid_config") from None
    except ConfigError as e:
        raise RequestError(422, str(e), "config", "invalid_config") from None


def parse_request(raw: bytes, content_type: str, query: dict[str, Any]) -> Request:
    """A JSON body {kind, config (object or YAML text), set, name, source, prompt, nproc}, or a YAML body
    that is the config itself (kind, set, name... then come from the query string)."""
    ctype = content_type.split(";")[0].strip().lower()
    if ctype in ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml"):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(400, "the YAML body is not UTF-8", "config") from None
        cfg = _load_yaml(text)
        body = {k: v for k, v in query.items() if k in ("kind", "name", "source", "prompt", "nproc")}
        body["set"] = query.get("set", [])
        body["config"] = {} if cfg is None else cfg
        lines = _key_lines("config", text)
    else:
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise RequestError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object", code="invalid_json")
        unknown = sorted(set(body) - {"kind", "config", "set", "name", "source", "prompt", "nproc"})
        if unknown:
            raise RequestError(400, f"unknown request field {unknown[0]!r}; valid fields: config, kind, "
                               "name, nproc, prompt, set, source", unknown[0])
        cfg, lines = body.get("config"), {}
        if isinstance(cfg, str):
            text = cfg
            cfg = _load_yaml(text)
            lines = _key_lines("config", text)
            cfg = {} if cfg is None else cfg
        else:
            # JSON is YAML: the key lines of the request body's "config" object, as a file's would be.
            try:
                text = raw.decode("utf-8")
                check_nesting(text, "request")  # before yaml reads it (slow on deep nesting)
                lines = {k[1:]: n for k, n in _key_lines("request", text).items() if k[:1] == ("config",)}
            except UnicodeDecodeError:
                lines = {}
            except ConfigError as e:
                raise RequestError(422, str(e), "config", "invalid_config") from None
    _check_text([body, cfg])  # cfg: YAML text in a JSON string holds its own escapes
    kind = body.get("kind", "train")
    if not isinstance(kind, str) or kind not in KINDS:
        raise RequestError(400, f"kind {kind!r} is not one of {', '.join(KINDS)}", "kind")
    sets = body.get("set") or []
    if isinstance(sets, str):
        sets = [sets]
    if not isinstance(sets, list) or not all(isinstance(s, str) for s in sets) or len(sets) > MAX_SETS:
        raise RequestError(400, f"set must be a list of at most {MAX_SETS} 'key=value' strings", "set")
    if kind == "train":
        if cfg is None:
            raise RequestError(422, "a train job needs a config (a JSON object or YAML text)", "config",
                               "invalid_config")
        if not isinstance(cfg, dict):
            raise RequestError(422, "config: the top level must be a mapping of sections", "config",
                               "invalid_config")
    elif cfg is not None:
        raise RequestError(400, f"a {kind} job runs on its source job's config; give set overrides "
                           "(eval.* / generate.*) instead of a config", "config")
    name = body.get("name")
    if name is not None and (not isinstance(name, str) or not _NAME_RE.match(name)):
        raise RequestError(400, "name: 1-128 letters, digits, spaces and ._:+-", "name")
    nproc = body.get("nproc")
    if nproc is not None:  # its bound is the server's (Limits, checked with the job): 422 past it
        if isinstance(nproc, str) and nproc.strip().isdigit():
            nproc = int(nproc)  # from a query string
        if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1 or kind != "train":
            raise RequestError(400, "nproc: the number of processes of a train job, a whole number >= 1",
                               "nproc")
    prompt = body.get("prompt")
    if prompt is not None and (not isinstance(prompt, str) or kind != "generate"):
        raise RequestError(400, "prompt: a string, for a generate job", "prompt")
    source = body.get("source")
    if kind != "train":
        if not isinstance(source, str):
            raise RequestError(400, f"a {kind} job needs source: the id of a train job of yours", "source")
    elif source is not None:
        raise RequestError(400, "source is for eval / generate / export jobs", "source")
    return Request(kind, cfg, lines, sets, name, source, prompt, nproc)


def _check_text(body: Any) -> None:
    """400 for a string no file or database can hold: a lone UTF-16 surrogate (JSON's "\\ud800"), which
    YAML and JSON both let through but UTF-8 cannot encode."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(400, f"the request holds text that is not valid Unicode ({e.reason}: "
                           f"{e.object[e.start:e.end]!a}); send UTF-8 text", code="invalid_text") from None
    except (TypeError, ValueError, RecursionError):  # not JSON-shaped (YAML's dates, sets): checked later
        pass


def _param_of(message: str) -> str | None:
    m = re.search(r"key '([^']+)'", message) or re.search(r"--set ([\w.]+)", message)
    return m.group(1) if m else None


def process_count(cfg, asked: int | None) -> int:
    """Processes of a train job: the parallel layout's product when it is explicit (dp_shard >= 1), else
    dp_replicate x tp x pp (dp_shard -1 fills what they leave), unless the request names `nproc`, which
    must be a multiple of the fixed dims (and equal the product when dp_shard is fixed)."""
    p = cfg.parallel
    fixed = p.dp_replicate * p.tp * p.pp
    layout = fixed * p.dp_shard if p.dp_shard >= 1 else None
    if asked is None:
        return layout or fixed
    if (layout is not None and asked != layout) or asked % fixed:
        want = layout if layout is not None else f"a multiple of {fixed}"
        raise RequestError(422, f"nproc={asked} does not fit the parallel layout (dp_replicate="
                           f"{p.dp_replicate}, dp_shard={p.dp_shard}, tp={p.tp}, pp={p.pp}): give {want}",
                           "nproc", "invalid_config")
    return asked


def _source_model(cfg) -> Any:
    """The model section a run starting from model.init_from builds: the source run's (its config.yaml,
    beside a checkpoint dir's run too) or a Hugging Face config.json's; None if not found (best effort:
    the run itself checks init_from). Read without torch: the API process does not import it."""
    from lmforge.config.schema import ModelConfig

    src = cfg.model.init_from
    if not src:
        return None
    p = Path(src)
    for d in (p, p.parent.parent):
        f = d / "config.yaml"
        if f.is_file() and f.stat().st_size < 1 << 20:
            try:
                model = (yaml.safe_load(f.read_text(encoding="utf-8")) or {}).get("model") or {}
                return ModelConfig.model_validate({k: v for k, v in model.items() if k != "init_from"})
            except Exception:  # noqa: BLE001 - not a readable lmforge config: no better guess than none
                return None
    f = p / "config.json"
    if f.is_file() and f.stat().st_size < 1 << 20:
        try:
            hf = json.loads(f.read_text(encoding="utf-8"))
            heads = int(hf["num_attention_heads"])
            return ModelConfig(d_model=int(hf["hidden_size"]), n_layers=int(hf["num_hidden_layers"]),
                               n_heads=heads, n_kv_heads=int(hf.get("num_key_value_heads") or heads),
                               d_ff=int(hf["intermediate_size"]), vocab_size=int(hf["vocab_size"]),
                               tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
        except Exception:  # noqa: BLE001 - another family's keys: no better guess than none
            return None
    return None


def train_ask(cfg, procs: int, limits: Limits) -> Ask:
    """What a train job of `cfg` on `procs` processes asks (see limits.py)."""
    # auto chooses among the cores the job is given: it asks for its share, as an unset value does.
    threads = cfg.train.threads if isinstance(cfg.train.threads, int) else limits.threads_for(procs)
    return Ask(procs, threads, memory_floor(cfg, procs, _source_model(cfg)))


def build_job(req: Request, user: str, workspace: Path, confiner: Confiner, get_job,
              limits: Limits | None = None) -> Job:
    """Validate `req` and make its job dir; the returned job is ready to be stored as queued."""
    limits = limits or Limits.for_machine()
    job_id = new_job_id()
    d = workspace / "jobs" / job_id
    own = lambda other: (j := get_job(other)) is not None and j.user == user  # noqa: E731
    now = time.time()
    if req.kind == "train":
        try:
            cfg = config_from_dict(req.config, req.sets, source="config", lines=req.lines)
            cfg = confiner.confine(cfg, job_id, own)
        except ConfinementError as e:
            raise RequestError(422, str(e), e.key, "path_not_allowed") from None
        except ConfigError as e:
            raise RequestError(422, str(e), _param_of(str(e)), "invalid_config") from None
        if cfg.train.max_steps > MAX_STEPS:  # stored in the job's row (a 64-bit integer)
            raise RequestError(422, f"train.max_steps={cfg.train.max_steps}: this server runs at most "
                               f"{MAX_STEPS:,} steps a job", "train.max_steps", "invalid_config")
        nproc = process_count(cfg, req.nproc)
        ask = train_ask(cfg, nproc, limits)
        _check(limits, ask)
        d.mkdir(parents=True)
        save_config(cfg, d / "config.yaml")
        spec = {"args": ["train", "-c", str(d / "config.yaml")], "ask": ask.to_json()}
        return Job(id=job_id, user=user, kind="train", name=req.name or cfg.run.name, status="queued",
                   created_at=now, queued_at=now, max_steps=cfg.train.max_steps, nproc=nproc, spec=spec)
    src = _source(req.source, user, get_job, workspace)
    sets = []
    for item in req.sets:
        try:
            key, _ = parse_override(item)
        except ConfigError as e:
            raise RequestError(422, str(e), "set", "invalid_config") from None
        if key.split(".")[0] not in ("eval", "generate"):
            raise RequestError(422, f"--set {key}: a {req.kind} job may only override eval.* and generate.* "
                               "keys (the run's own config fixes the rest)", "set", "invalid_config")
        sets += ["--set", item]
    run = str(workspace / "jobs" / src.id / "run")
    ask = Ask(1, limits.threads_for(1), PROCESS_BASE_BYTES)  # one process, loading the run's weights
    _check(limits, ask)
    d.mkdir(parents=True)
    archive = None
    if req.kind == "eval":
        args = ["eval", "loss", run, *sets]
    elif req.kind == "generate":
        args = ["generate", run, *sets] + (["--prompt", req.prompt] if req.prompt is not None else [])
    else:
        args = ["export", run, str(d / "export")]
        archive = {"src": "export", "dst": "export.zip"}
    return Job(id=job_id, user=user, kind=req.kind, name=req.name or f"{req.kind} of {src.name}",
               status="queued", created_at=now, queued_at=now, source=src.id,
               spec={"args": args, "archive": archive, "ask": ask.to_json()})


def _check(limits: Limits, ask: Ask) -> None:
    try:
        limits.check(ask)
    except OverAsk as e:
        raise RequestError(422, str(e), e.param, "over_limit") from None


def _source(source: str, user: str, get_job, workspace: Path) -> Job:
    try:
        check_job_id(source)
    except ConfinementError as e:
        raise RequestError(404, str(e), "source", "job_not_found") from None
    src = get_job(source)
    if src is None or src.user != user:
        raise RequestError(404, f"no job {source!r}", "source", "job_not_found")
    if src.kind != "train":
        raise RequestError(422, f"source {source} is a {src.kind} job; give a train job", "source")
    ckpts = workspace / "jobs" / src.id / "run" / "checkpoints"
    if src.status not in ("succeeded", *RESUMABLE) or not ckpts.is_dir() or not any(ckpts.iterdir()):
        raise RequestError(409, f"source {source} has no checkpoint to use yet (status {src.status})",
                           "source", "source_not_ready")
    return src


def job_json(job: Job, workspace: Path, progress: Progress) -> dict[str, Any]:
    """The public shape of a job (the OpenAI fine-tuning job's fields where they apply)."""
    d = workspace / "jobs" / job.id
    train, val = progress.latest(job.id, d / "run" / "metrics.jsonl") if job.kind == "train" else (None, None)
    step = train.get("step") if train else None
    eta = eta_seconds(train, job.max_steps) if job.status == "running" else None
    metrics = {k: v for k, v in (train or {}).items() if isinstance(v, (int, float)) and math.isfinite(v)}
    val_metrics = {k: v for k, v in (val or {}).items() if isinstance(v, (int, float)) and math.isfinite(v)}
    error = None
    if job.error:
        error = {"code": "job_" + job.status, "message": job.error, "param": None}
    return {
        "id": job.id, "object": "lmforge.job", "kind": job.kind, "name": job.name, "status": job.status,
        "created_at": int(job.created_at), "started_at": _int(job.started_at),
        "finished_at": _int(job.finished_at), "error": error, "exit_code": job.exit_code,
        "source": job.source, "step": step, "max_steps": job.max_steps,
        "progress": (step / job.max_steps) if step is not None and job.max_steps else None,
        "metrics": metrics, "val_metrics": val_metrics,
        "tokens_per_s": metrics.get("tokens_per_s"), "eta_seconds": None if eta is None else round(eta, 1),
        "attempts": job.attempts, "nproc": job.nproc, "resources": _resources(job),
        "resumable": job.kind == "train" and job.status in RESUMABLE,
    }


def _resources(job: Job) -> dict[str, Any]:
    """What the job asked of the server: processes, threads per process, memory (GiB, the floor it needs)."""
    ask = Ask.of(job.spec, job.nproc)
    return {"procs": ask.procs, "threads": ask.threads, "memory_gb": round(ask.memory / GIB, 3)}


def _int(t: float | None) -> int | None:
    return None if t is None else int(t)
