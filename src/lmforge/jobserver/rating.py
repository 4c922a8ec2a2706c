"""Human evaluation: blind side-by-side rating studies, kept in <workspace>/ratings.db.

A study compares two systems, X and Y (two runs of the job server, or two answer lists the owner gives),
on the same prompts. Its owner names its raters (user names of the server's tokens): that list is the
study's scope. A rater sees the study's name, each prompt and the two answers as "A" and "B"; which of X
and Y is A is drawn per rater and item from the study's secret seed, so neither the page nor its requests
say which run wrote which answer. Only the owner sees the runs' labels, the results and the exports; to
anyone else the study does not exist (404, as a missing one).

A choice is stored as the run it favours (x / y / tie), so results never depend on the display order.
Saving the same choice twice changes nothing (idempotent); saving another replaces it.

The file is separate from server.db (the job store): its own connection, WAL journal, one writer lock.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.jobserver.auth import USER_RE
from lmforge.jobserver.jobs import RequestError
from lmforge.jobserver.store import LockedDB

DB_NAME = "ratings.db"
MAX_ITEMS = 500           # prompts in one study
MAX_PROMPT_CHARS = 8_000
MAX_ANSWER_CHARS = 16_000
MAX_COMMENT_CHARS = 2_000
MAX_RATERS = 50
MAX_LABEL_CHARS = 128
MAX_STUDIES_PER_OWNER = 200
CHOICES = ("A", "B", "tie")
SIDES = ("x", "y")
_NAME_RE = re.compile(r"^[\w .:+-]{1,128}$")
_STUDY_RE = re.compile(r"^study-[0-9a-f]{16}$")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS studies (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    status TEXT NOT NULL,
    error TEXT,
    created_at REAL NOT NULL,
    secret TEXT NOT NULL,
    raters TEXT NOT NULL,
    labels TEXT NOT NULL,
    sources TEXT NOT NULL,
    n_items INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS items (
    study TEXT NOT NULL,
    idx INTEGER NOT NULL,
    prompt TEXT NOT NULL,
    answer_x TEXT,
    answer_y TEXT,
    PRIMARY KEY (study, idx)
);
CREATE TABLE IF NOT EXISTS ratings (
    study TEXT NOT NULL,
    rater TEXT NOT NULL,
    idx INTEGER NOT NULL,
    winner TEXT NOT NULL,
    comment TEXT NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (study, rater, idx)
);
"""


@dataclass
class Study:
    id: str
    owner: str
    name: str
    status: str          # generating | ready | failed
    error: str | None
    created_at: float
    secret: str
    raters: list[str]
    labels: dict[str, str]
    sources: dict[str, str | None]  # side -> the job whose run wrote its answers (None: given)
    n_items: int


def x_is_a(secret: str, rater: str, idx: int) -> bool:
    """Whether run X is shown as answer A to `rater` on item `idx`: a fair coin drawn from the study's
    secret, fixed per rater and item (so a reload shows the same order) and unknowable without it."""
    return hashlib.sha256(f"{secret}\0{rater}\0{idx}".encode()).digest()[0] & 1 == 0


def winner_of(choice: str, x_first: bool) -> str:
    """The side ("x" / "y" / "tie") a displayed choice ("A" / "B" / "tie") favours."""
    if choice == "tie":
        return "tie"
    return "x" if (choice == "A") == x_first else "y"


def choice_of(winner: str, x_first: bool) -> str:
    if winner == "tie":
        return "tie"
    return "A" if (winner == "x") == x_first else "B"


def check_study_id(study_id: str) -> None:
    if not _STUDY_RE.match(study_id or ""):
        raise RequestError(404, f"no study {study_id!r}", "id", "study_not_found")


# -- the create request ------------------------------------------------------------------------------

def _text_list(value: Any, field: str, key: str, limit: int) -> list[str]:
    """A list of strings, or JSONL text whose lines are objects with a string `key` (an answer file)."""
    if isinstance(value, str):
        out = []
        for n, line in enumerate(value.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise RequestError(400, f"{field}: line {n} is not JSON ({e.msg})", field) from None
            if not isinstance(rec, dict) or not isinstance(rec.get(key), str):
                raise RequestError(400, f"{field}: line {n} needs a string {key!r} field, e.g. "
                                   f'{{"{key}": "..."}}', field)
            out.append(rec[key])
        value = out
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RequestError(400, f"{field}: a list of strings, or JSONL text with a {key!r} per line", field)
    if len(value) > MAX_ITEMS:
        raise RequestError(400, f"{field}: {len(value)} entries; a study has at most {MAX_ITEMS}", field)
    for i, v in enumerate(value):
        if len(v) > limit:
            raise RequestError(400, f"{field}[{i}]: {len(v)} characters; at most {limit}", field)
    return value


def parse_study(body: Any, owner: str) -> dict[str, Any]:
    """Validate a create request {name, raters, prompts, x, y, seed?}; x / y are {"label", "answers"}
    (answers given) or {"job"} (the server generates them with that train job's run)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object {name, raters, prompts, x, y}")
    unknown = sorted(set(body) - {"name", "raters", "prompts", "x", "y", "seed", "max_new_tokens"})
    if unknown:
        raise RequestError(400, f"unknown field {unknown[0]!r}; the fields are name, raters, prompts, x, y, "
                           "seed, max_new_tokens", unknown[0])
    name = body.get("name", "study")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise RequestError(400, "name: 1-128 letters, digits, spaces or . : + - _ (raters see it: do not put "
                           "the runs' names in it)", "name")
    raters = body.get("raters")
    if not isinstance(raters, list) or not raters or len(raters) > MAX_RATERS:
        raise RequestError(400, f"raters: a list of 1-{MAX_RATERS} user names (the users whose tokens may "
                           "rate)", "raters")
    for r in raters:
        if not isinstance(r, str) or not USER_RE.match(r):
            raise RequestError(400, f"raters: {r!r} is not a user name (letters, digits, . _ -)", "raters")
    if len(set(raters)) != len(raters):
        raise RequestError(400, "raters: a user is listed twice", "raters")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise RequestError(400, "seed: a whole number in [0, 2**63)", "seed")
    max_new = body.get("max_new_tokens", 128)
    if isinstance(max_new, bool) or not isinstance(max_new, int) or not 1 <= max_new <= 1024:
        raise RequestError(400, "max_new_tokens: a whole number in [1, 1024] (answers the server generates)",
                           "max_new_tokens")
    prompts = _text_list(body.get("prompts"), "prompts", "prompt", MAX_PROMPT_CHARS)
    if not prompts:
        raise RequestError(400, "prompts: give at least one prompt", "prompts")
    sides: dict[str, dict[str, Any]] = {}
    for side in SIDES:
        spec = body.get(side)
        if not isinstance(spec, dict) or len({"answers", "job"} & set(spec)) != 1:
            raise RequestError(400, f'{side}: {{"label": ..., "answers": [...]}} or {{"job": "job-..."}}',
                               side)
        bad = sorted(set(spec) - {"label", "answers", "job"})
        if bad:
            raise RequestError(400, f"{side}.{bad[0]}: unknown; give label and answers, or job",
                               f"{side}.{bad[0]}")
        label = spec.get("label", spec.get("job", side.upper()))
        if not isinstance(label, str) or not 0 < len(label) <= MAX_LABEL_CHARS:
            raise RequestError(400, f"{side}.label: 1-{MAX_LABEL_CHARS} characters", f"{side}.label")
        if "job" in spec:
            if not isinstance(spec["job"], str):
                raise RequestError(400, f"{side}.job: a job id", f"{side}.job")
            sides[side] = {"label": label, "job": spec["job"], "answers": None}
            continue
        answers = _text_list(spec["answers"], f"{side}.answers", "answer", MAX_ANSWER_CHARS)
        if len(answers) != len(prompts):
            raise RequestError(400, f"{side}.answers: {len(answers)} answers for {len(prompts)} prompts; "
                               "give one per prompt, in the same order", f"{side}.answers")
        sides[side] = {"label": label, "job": None, "answers": answers}
    if "max_new_tokens" in body and all(s["job"] is None for s in sides.values()):
        raise RequestError(400, "max_new_tokens: only for a side the server generates ({\"job\": ...}); both "
                           "sides' answers are given", "max_new_tokens")
    if sides["x"]["label"] == sides["y"]["label"]:
        raise RequestError(400, "y.label: the two sides need different labels", "y.label")
    secret = hashlib.sha256(f"lmforge-study\0{seed}".encode()).hexdigest() if seed is not None \
        else secrets.token_hex(32)
    return {"owner": owner, "name": name, "raters": raters, "secret": secret, "prompts": prompts,
            "sides": sides, "max_new_tokens": max_new}


class RatingStore(LockedDB):
    """Studies, their items and the ratings in `<workspace>/ratings.db`."""

    def __init__(self, workspace: str | Path) -> None:
        self.path = Path(workspace) / DB_NAME
        self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            # A server that stopped while generating left its thread's work undone: say so.
            self._db.execute("UPDATE studies SET status = 'failed', error = 'the server stopped while "
                             "generating the answers; create the study again' WHERE status = 'generating'")
        try:
            self.path.chmod(0o600)  # prompts, answers and comments: the operator's and the owners'
        except OSError:
            pass

    def create(self, req: dict[str, Any]) -> Study:
        sides = req["sides"]
        generating = any(s["answers"] is None for s in sides.values())
        sid = f"study-{secrets.token_hex(8)}"
        with self._tx() as db:
            (owned,) = db.execute("SELECT COUNT(*) FROM studies WHERE owner = ?", (req["owner"],)).fetchone()
            if owned >= MAX_STUDIES_PER_OWNER:
                raise RequestError(409, f"{req['owner']} owns {owned} studies, the most one user may; delete "
                                   "some (DELETE /v1/studies/ID)", None, "too_many_studies")
            db.execute("INSERT INTO studies (id, owner, name, status, created_at, secret, raters, labels, "
                       "sources, n_items) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (sid, req["owner"], req["name"], "generating" if generating else "ready", time.time(),
                        req["secret"], json.dumps(req["raters"]),
                        json.dumps({k: v["label"] for k, v in sides.items()}),
                        json.dumps({k: v["job"] for k, v in sides.items()}), len(req["prompts"])))
            xs, ys = sides["x"]["answers"], sides["y"]["answers"]
            db.executemany("INSERT INTO items (study, idx, prompt, answer_x, answer_y) "
                           "VALUES (?, ?, ?, ?, ?)",
                           [(sid, i, p, xs[i] if xs else None, ys[i] if ys else None)
                            for i, p in enumerate(req["prompts"])])
        return self.get(sid)

    def get(self, study_id: str) -> Study | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM studies WHERE id = ?", (study_id,)).fetchone()
        if row is None:
            return None
        d = dict(row)
        return Study(id=d["id"], owner=d["owner"], name=d["name"], status=d["status"], error=d["error"],
                     created_at=d["created_at"], secret=d["secret"], raters=json.loads(d["raters"]),
                     labels=json.loads(d["labels"]), sources=json.loads(d["sources"]), n_items=d["n_items"])

    def visible(self, user: str) -> list[Study]:
        """The studies `user` owns or rates, newest first."""
        with self._lock:
            ids = [r[0] for r in self._db.execute("SELECT id FROM studies ORDER BY seq DESC").fetchall()]
        out = [self.get(i) for i in ids]
        return [s for s in out if s is not None and (s.owner == user or user in s.raters)]

    def set_answers(self, study_id: str, side: str, answers: list[str]) -> None:
        col = {"x": "answer_x", "y": "answer_y"}[side]
        with self._tx() as db:
            db.executemany(f"UPDATE items SET {col} = ? WHERE study = ? AND idx = ?",
                           [(a, study_id, i) for i, a in enumerate(answers)])

    def set_status(self, study_id: str, status: str, error: str | None = None) -> None:
        with self._tx() as db:
            db.execute("UPDATE studies SET status = ?, error = ? WHERE id = ?", (status, error, study_id))

    def item(self, study_id: str, idx: int) -> sqlite3.Row | None:
        with self._lock:
            return self._db.execute("SELECT * FROM items WHERE study = ? AND idx = ?",
                                    (study_id, idx)).fetchone()

    def items(self, study_id: str) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute("SELECT * FROM items WHERE study = ? ORDER BY idx",
                                    (study_id,)).fetchall()

    def rate(self, study_id: str, rater: str, idx: int, winner: str, comment: str) -> None:
        """Save (or replace) `rater`'s choice on item `idx`; saving the same again changes nothing."""
        with self._tx() as db:
            db.execute("INSERT INTO ratings (study, rater, idx, winner, comment, updated_at) VALUES "
                       "(?, ?, ?, ?, ?, ?) ON CONFLICT (study, rater, idx) DO UPDATE SET "
                       "winner = excluded.winner, comment = excluded.comment, "
                       "updated_at = excluded.updated_at "
                       "WHERE winner != excluded.winner OR comment != excluded.comment",
                       (study_id, rater, idx, winner, comment, time.time()))

    def ratings(self, study_id: str, rater: str | None = None) -> list[sqlite3.Row]:
        sql, args = "SELECT * FROM ratings WHERE study = ?", [study_id]
        if rater is not None:
            sql, args = sql + " AND rater = ?", [*args, rater]
        with self._lock:
            return self._db.execute(sql + " ORDER BY rater, idx", args).fetchall()

    def delete(self, study_id: str) -> None:
        with self._tx() as db:
            for table, col in (("ratings", "study"), ("items", "study"), ("studies", "id")):
                db.execute(f"DELETE FROM {table} WHERE {col} = ?", (study_id,))
