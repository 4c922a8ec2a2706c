"""A precomputed teacher for distillation: the teacher's k largest logits (and their token ids) at every
position of every training and validation window, written once so that the student's run does not
run the teacher each step (a large teacher, or many students from one teacher).

The pretraining loader cuts each split into fixed non-overlapping windows of seq_len tokens (see
lmforge.data.loader), so one pass over all windows covers every row any seed, batch size or world
size will read. Rows are found again by content: the key of a window is the first 8 bytes of the
BLAKE2b hash of its int64 token ids, which makes the lookup independent of the order the loader
visits them.

Layout of the cache dir (safetensors and JSON only; nothing executable is read back):
    meta.json                 teacher, seq_len, k, vocabulary fingerprint, files
    <split>-NNNNN.safetensors keys (n,) int64, ids (n, T, k) int32, logits (n, T, k) float16,
                              lse (n, T) float32: logsumexp(logits / temperature) over the vocabulary
The temperature is fixed when the cache is written (the log-normaliser depends on it).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from lmforge.data.batch import TokenBatch
from lmforge.data.loader import TokenLoader
from lmforge.engine.objectives.distill import TopK
from lmforge.errors import ConfigError, DataError
from lmforge.utils.io import atomic_write_json

FORMAT = "lmforge-topk-cache-1"
ROWS_PER_FILE = 2048


def row_keys(input_ids: torch.Tensor) -> list[int]:
    """The cache key of each row of input_ids (B, T)."""
    rows = input_ids.detach().to("cpu", torch.int64).numpy()
    return [int.from_bytes(hashlib.blake2b(r.tobytes(), digest_size=8).digest(), "little", signed=True)
            for r in rows]


def vocab_fingerprint(tokenizer: Any) -> str:
    """A hash of a tokenizer's token -> id map: caches are only valid for the same vocabulary."""
    vocab = sorted(tokenizer.hf.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


@torch.no_grad()
def write_topk_cache(out: Path, teacher: torch.nn.Module, shards: dict[str, list[Path]], seq_len: int, k: int,
                     tokenizer: Any, teacher_path: str, temperature: float = 1.0, batch_size: int = 16,
                     say=print) -> dict:
    """Run `teacher` over every window of each split's shards and write its top-k logits to `out`
    (a new dir written beside and renamed into place)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"distill.topk_cache={out} already exists and is not empty; remove it or choose "
                          "another dir")
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    device = next(teacher.parameters()).device
    files: dict[str, list[str]] = {}
    for split, paths in shards.items():
        loader = TokenLoader(paths, seq_len, batch_size, shuffle=False, drop_last=False)
        part = _Part(tmp, split)
        for batch in loader.iter_eval_batches():
            logits = teacher(batch.input_ids.to(device)).float()  # (B, T, V)
            top = logits.topk(k, dim=-1)  # values / indices (B, T, k)
            lse = torch.logsumexp(logits / temperature, dim=-1)  # (B, T)
            part.add(row_keys(batch.input_ids), top.indices.to("cpu", torch.int32),
                     top.values.to("cpu", torch.float16), lse.cpu())
        files[split] = part.close()
        say(f"teacher top-{k} of {loader.num_windows:,} {split} windows written")
    meta = {"format": FORMAT, "teacher": teacher_path, "seq_len": seq_len, "k": k, "temperature": temperature,
            "vocab": vocab_fingerprint(tokenizer), "files": files}
    atomic_write_json(tmp / "meta.json", meta)
    tmp.rename(out)
    return meta


class _Part:
    """One split's rows, written ROWS_PER_FILE at a time."""

    def __init__(self, dir: Path, split: str) -> None:
        self.dir, self.split, self.names = dir, split, []
        self.keys: list[int] = []
        self.ids: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.lse: list[torch.Tensor] = []

    def add(self, keys: list[int], ids: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor) -> None:
        self.keys += keys
        self.ids.append(ids)
        self.logits.append(logits)
        self.lse.append(lse)
        if len(self.keys) >= ROWS_PER_FILE:
            self._flush()

    def close(self) -> list[str]:
        self._flush()
        return self.names

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self.keys:
            return
        name = f"{self.split}-{len(self.names):05d}.safetensors"
        save_file({"keys": torch.tensor(self.keys, dtype=torch.int64), "ids": torch.cat(self.ids),
                   "logits": torch.cat(self.logits), "lse": torch.cat(self.lse)}, str(self.dir / name))
        self.names.append(name)
        self.keys, self.ids, self.logits, self.lse = [], [], [], []


class TopKCache:
    """The teacher of objective distill read from a cache dir: batch -> TopK(ids, logits) (B, T, k)."""

    def __init__(self, path: str | Path, seq_len: int, temperature: float, tokenizer: Any,
                 device: torch.device) -> None:
        from safetensors import safe_open

        self.path, self.device = Path(path), device
        meta_file = self.path / "meta.json"
        try:
            meta = json.loads(meta_file.read_text())
            ok = meta.get("format") == FORMAT and isinstance(meta.get("files"), dict)
        except (OSError, ValueError):
            ok = False
        if not ok:
            raise ConfigError(f"distill.topk_cache={path}: not a teacher top-k cache (no readable "
                              f"{meta_file}); write one with lmforge distill -c CONFIG --precompute-topk")
        if meta["seq_len"] != seq_len:
            raise ConfigError(f"distill.topk_cache={path} holds windows of {meta['seq_len']} tokens, the run "
                              f"reads {seq_len}: precompute it again for this train.seq_len")
        if meta.get("temperature") != temperature:
            raise ConfigError(f"distill.topk_cache={path} was written at distill.temperature="
                              f"{meta.get('temperature')}, the run uses {temperature}: precompute it again")
        if tokenizer is not None and meta["vocab"] != vocab_fingerprint(tokenizer):
            raise ConfigError(f"distill.topk_cache={path} was written with another tokenizer than the run's")
        self.k = int(meta["k"])
        self._rows: dict[int, tuple[Any, int]] = {}
        for names in meta["files"].values():
            for name in names:
                file = self.path / Path(name).name  # names stay inside the cache dir
                handle = safe_open(str(file), framework="pt")
                for i, key in enumerate(handle.get_tensor("keys").tolist()):
                    self._rows[key] = (handle, i)

    def __len__(self) -> int:
        return len(self._rows)

    def __call__(self, batch: TokenBatch) -> TopK:
        ids, logits, lse = [], [], []
        for key in row_keys(batch.input_ids):
            hit = self._rows.get(key)
            if hit is None:
                raise ConfigError(f"distill.topk_cache={self.path} has no entry for a row of this batch: the "
                                  "data changed since the cache was written; precompute it again")
            handle, i = hit
            ids.append(handle.get_slice("ids")[i:i + 1])
            logits.append(handle.get_slice("logits")[i:i + 1])
            lse.append(handle.get_slice("lse")[i:i + 1])
        return TopK(torch.cat(ids).to(self.device), torch.cat(logits).to(self.device, torch.float32),
                    torch.cat(lse).to(self.device))


def shard_splits(data: Any) -> dict[str, list[Path]]:
    """The train and (when prepared) val shard files of prepared pretraining data."""
    out = {"train": data.shards("train")}
    try:
        val = data.shards("val")
    except DataError:  # prepared without a validation split
        val = []
    if val:
        out["val"] = val
    return out


def precompute_topk(cfg: Any, say=print) -> dict:
    """`lmforge distill -c CONFIG --precompute-topk`: prepare the run's data, load distill.teacher and
    write its top-k cache to distill.topk_cache."""
    import math

    from lmforge.data.prepare import prepare
    from lmforge.finetune.teacher import load_teacher

    d = cfg.distill
    if not d.topk_cache or not d.teacher:
        raise ConfigError("--precompute-topk writes distill.teacher's top-k logits to distill.topk_cache: "
                          "set both")
    data = prepare(cfg, console=say)
    vocab = cfg.model.vocab_size or 64 * math.ceil(data.tokenizer.vocab_size / 64)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    teacher = load_teacher(d.teacher, d.teacher_weights, vocab, data.tokenizer, device, say)
    return write_topk_cache(Path(d.topk_cache), teacher, shard_splits(data), cfg.seq_len, d.topk,
                            data.tokenizer, d.teacher, temperature=d.temperature,
                            batch_size=cfg.eval.batch_size, say=say)


__all__ = ["TopKCache", "precompute_topk", "row_keys", "shard_splits", "vocab_fingerprint",
           "write_topk_cache"]
