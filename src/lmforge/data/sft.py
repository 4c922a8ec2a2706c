"""Conversations -> token ids and the tokens that carry the loss (lmforge.data.sft_examples) -> a
prepared SFT data dir.

The prepared dir holds, per split, the concatenated ids (int32), masks (uint8) and example offsets
(int64) as .npy files (never pickled), the tokenizer (with the template's control tokens), the template
and meta.json, written last, in a sibling that is renamed into place, and reused when its fingerprint
matches, like `prepare`'s token shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmforge._version import __version__
from lmforge.config.methods import method_facts
from lmforge.config.schema import Config
from lmforge.data.chat import ChatStats, Conversation, read_conversations
from lmforge.data.chat_template import (
    CHATML_TOKENS,
    TEMPLATE_FILE,
    ChatTemplate,
    TemplateError,
    read_text,
    shipped_template,
    template_specials,
    tokenizer_config,
)
from lmforge.data.prepare import TOKENIZER_FILE, data_dir, split_of
from lmforge.data.sft_examples import (  # noqa: F401 - Example, label_mask, fit: this module's API too
    Example,
    batches,
    check_contents,
    fit,
    label_mask,
    message_chars,
)
from lmforge.data.shards import read_meta, write_meta
from lmforge.data.task_data import task_kinds
from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import DataError
from lmforge.utils.jsontext import loads

FORMAT = 1
KIND = "sft"
PREFERENCE_KIND = "preference"  # the same layout: examples 2i and 2i+1 are pair i's chosen and rejected
PROMPT_KIND = "prompts"  # RL: each example a prompt (no loss tokens), its record's info in {split}_info.json
# (preference data keeps each pair's margin there)
UNPAIRED_KIND = "unpaired"  # KTO: each example one (prompt, completion), its label in {split}_info.json
KINDS = (KIND, PREFERENCE_KIND, PROMPT_KIND, UNPAIRED_KIND)
INFO_FILE = "{split}_info.json"


def kind_of(cfg: Config) -> str:
    """What the run's chat data dir holds: conversations (objective sft), preference pairs (dpo) or
    prompts (rl)."""
    kinds = {"pairs": PREFERENCE_KIND, "unpaired": UNPAIRED_KIND, "prompts": PROMPT_KIND}
    return kinds.get(method_facts(cfg).data, KIND)


def _sources(cfg: Config) -> tuple[list[str], list[str], float]:
    """(data, val_data, val_fraction) of the section the objective reads."""
    facts = method_facts(cfg)
    s = getattr(cfg, facts.data_section) if facts.chat else cfg.sft
    return list(s.data), list(s.val_data), s.val_fraction
SPLITS = ("train", "val")


# -- the prepared dir ---------------------------------------------------------------------------------
@dataclass
class SFTSplit:
    """One split's examples, in the order they were read."""

    ids: np.ndarray  # int32, all examples back to back
    mask: np.ndarray  # uint8, the same length
    offsets: np.ndarray  # int64 (examples + 1,)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[a:b], self.mask[a:b].astype(bool)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @classmethod
    def of(cls, examples: list[Example]) -> SFTSplit:
        lengths = np.asarray([len(e.ids) for e in examples], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        ids = np.concatenate([e.ids for e in examples]) if examples else np.zeros(0, np.int32)
        mask = (
            np.concatenate([e.mask for e in examples]).astype(np.uint8) if examples else np.zeros(0, np.uint8)
        )
        return cls(ids.astype(np.int32), mask, offsets)


@dataclass
class PreparedSFT:
    dir: Path
    tokenizer: Tokenizer
    template: ChatTemplate
    meta: dict

    def split(self, name: str) -> SFTSplit:
        if name not in self.meta["splits"]:
            raise DataError(f"unknown split {name!r}; valid splits: {', '.join(self.meta['splits'])}")
        arrays = [
            np.load(self.dir / f"{name}_{part}.npy", allow_pickle=False, mmap_mode="r")
            for part in ("ids", "mask", "offsets")
        ]
        return SFTSplit(*arrays)

    def info(self, name: str) -> list[dict] | None:
        """RL prompts: each example's record info (answer, task, ...), what its rewards check;
        preference pairs: each pair's margin. None where the dir has none (prepared before margins)."""
        path = self.dir / INFO_FILE.format(split=name)
        if not path.exists():
            return None
        try:
            info = loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:  # BadJSON too: nested past the recursion limit
            raise DataError(f"{path}: cannot read the prompts' answers ({e}); prepare the data "
                            "again") from None
        if not isinstance(info, list) or not all(isinstance(i, dict) for i in info):
            raise DataError(f"{path}: expected a list of objects; prepare the data again")
        return info


def load_template(dir: Path, meta: dict) -> ChatTemplate:
    t = meta["template"]
    return ChatTemplate(
        read_text(dir / TEMPLATE_FILE),
        t.get("special_tokens") or {},
        name=t.get("name", "chat template"),
        end_of_turn=t.get("end_of_turn"),
        variables=t.get("variables") or {},
    )


def load_prepared_sft(dir: str | Path) -> PreparedSFT:
    dir = Path(dir)
    meta = read_meta(dir)
    if meta is not None and meta.get("kind") == "labelled":  # a classifier's records (data/labelled.py)
        from lmforge.data.labelled import load_prepared_labelled

        return load_prepared_labelled(dir)
    if meta is not None and meta.get("kind") in task_kinds():  # tagged words, SQuAD-like questions
        from lmforge.data.task_data import load_task_data

        return load_task_data(dir)
    if meta is None or meta.get("kind") not in KINDS:
        raise DataError(
            f"{dir} holds no prepared SFT, preference or RL prompt data; run `lmforge sft` / `dpo` / `rl` "
            "with their config"
        )
    tok = Tokenizer.load(dir / TOKENIZER_FILE, eos_id=meta["eos_id"])
    return PreparedSFT(dir, tok, load_template(dir, meta), meta)


def resolve_template(cfg: Config, tok_path: Path | None, tok: Tokenizer) -> ChatTemplate:
    """The template `sft.template` names, with the special tokens it may use; adds ChatML's control
    tokens to `tok` when it is chosen."""
    choice, variables = cfg.sft.template, cfg.sft.template_kwargs
    config = tokenizer_config(tok_path)
    own = shipped_template(tok_path, config)
    if choice == "auto":
        choice = "tokenizer" if own is not None else "chatml"
    if choice == "chatml":
        tok.add_special_tokens(CHATML_TOKENS)
        return ChatTemplate.chatml(variables)
    specials = template_specials(config, tok)
    if choice == "tokenizer":
        if own is None:
            raise DataError(f"sft.template=tokenizer: {tok_path.parent} has no chat template (chat_template "
                            "in tokenizer_config.json, or chat_template.jinja)")
        source, name = own
    else:
        path = Path(choice)
        if not path.is_file():
            raise DataError(f"sft.template={choice!r}: no such file; give auto, chatml or a .jinja file")
        source, name = read_text(path), f"the chat template {path}"
    return ChatTemplate(source, specials, name=name, end_of_turn=specials.get("eos_token"),
                        variables=variables)


def _settings(cfg: Config, tok_file: Path) -> dict:
    s = cfg.sft
    data, val_data, val_fraction = _sources(cfg)
    files = []
    for src in [*data, *val_data]:
        p = Path(src)
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file():
                st = f.stat()
                files.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    tok_hash = hashlib.sha256(tok_file.read_bytes()).hexdigest() if tok_file.is_file() else None
    template = Path(s.template)
    return {
        "format": FORMAT,
        "kind": kind_of(cfg),
        "data": data,
        "val_data": val_data,
        "val_fraction": val_fraction,
        "record_format": s.format,
        "template": s.template,
        "template_hash": hashlib.sha256(template.read_bytes()).hexdigest() if template.is_file() else None,
        "template_kwargs": s.template_kwargs,
        "loss_on": s.loss_on,
        "overlong": s.overlong,
        "on_bad_record": s.on_bad_record,
        "seq_len": cfg.seq_len,
        "seed": cfg.run.seed,
        "tokenizer": tok_hash,
        "files": files,
    }


def prepare_sft(cfg: Config, console: Callable[[str], object] = print, replace: bool = False) -> PreparedSFT:
    """Prepare (or reuse) the SFT examples `cfg` describes in the run's data dir. `replace`: an SFT
    preparation there with other settings is the run's own (a fresh run in its own dir) and is prepared
    again; otherwise that is an error."""
    if method_facts(cfg).data == "labelled":  # a classifier's records: their own layout (data/labelled.py)
        from lmforge.data.labelled import prepare_labelled

        return prepare_labelled(cfg, console, replace)
    if method_facts(cfg).data in task_kinds():  # tagged words, SQuAD-like questions (data/task_data.py)
        from lmforge.data.task_data import prepare_task_data

        return prepare_task_data(cfg, console, replace)
    kind = kind_of(cfg)
    if not _sources(cfg)[0]:
        what = {PROMPT_KIND: "prompts", KIND: "chat data"}.get(kind, "preference pairs")
        key = method_facts(cfg).data_keys[0] if method_facts(cfg).chat else "sft.data"
        raise DataError(
            f"objective {cfg.objective.name} needs {what}: set {key} to .jsonl / .parquet files or a saved "
            "datasets dir"
        )
    tok_path = Path(cfg.data.tokenizer.path) if cfg.data.tokenizer.path else None
    if tok_path is None:
        raise DataError(
            "sft needs the tokenizer of the model it fine-tunes: set model.init_from (its "
            "tokenizer is used) or data.tokenizer.path"
        )
    if tok_path.is_dir():
        tok_path = tok_path / TOKENIZER_FILE
    out = data_dir(cfg)
    settings = _settings(cfg, tok_path)
    fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    if out.exists():
        meta = read_meta(out)
        if meta is not None and meta.get("fingerprint") == fingerprint and meta.get("kind") == kind:
            console(f"reusing prepared {kind} data in {out}")
            return load_prepared_sft(out)
        stale = replace and meta is not None and meta.get("kind") in KINDS
        if stale:
            console(f"the {kind} data or its settings changed since {out} was prepared: preparing it again")
        elif meta is not None or any(out.iterdir()):
            raise DataError(
                f"data dir {out} holds other data (prepared with other settings or for "
                "pretraining); choose another data.dir or delete it to prepare again"
            )
    t0 = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-sft-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        meta = _build(cfg, tok_path, tmp, console)
        meta.update(fingerprint=fingerprint, settings=settings, seconds=round(time.perf_counter() - t0, 2))
        write_meta(tmp, meta)
        if out.exists() and stale:  # the run's own earlier preparation: swapped out only now it is built
            old = out.with_name(f".{out.name}.old-sft-{os.getpid()}")
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            if out.exists():
                out.rmdir()  # empty (checked above)
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for name, sp in meta["splits"].items():
        n = sp["examples"]
        what = {PREFERENCE_KIND: f"{n // 2:,} pairs", PROMPT_KIND: f"{n:,} prompts",
                UNPAIRED_KIND: f"{n:,} unpaired examples"}.get(
            kind, f"{n:,} conversations")
        console(f"{kind} {name}: {what}, {sp['tokens']:,} tokens, {sp['loss_tokens']:,} with loss")
    return load_prepared_sft(out)


def _reader(kind: str, s, stats: ChatStats) -> Callable:
    """sources -> the records of this kind of data (conversations, pairs, unpaired examples, prompts)."""
    if kind == PREFERENCE_KIND:
        from lmforge.data.preference import read_pairs

        return lambda sources: read_pairs(sources, s.on_bad_record, stats)
    if kind == UNPAIRED_KIND:
        from lmforge.data.preference import read_unpaired

        return lambda sources: read_unpaired(sources, s.on_bad_record, stats)
    if kind == PROMPT_KIND:
        from lmforge.data.prompts import read_prompts

        return lambda sources: read_prompts(sources, s.on_bad_record, stats)
    return lambda sources: read_conversations(sources, s.format, s.on_bad_record, stats)


def _report(cfg: Config, kind: str, stats: ChatStats, counts: dict[str, int], bad_examples: list[str],
            any_train: bool, console: Callable[[str], object]) -> None:
    """What was read and skipped, on the console; DataError when no training example is left."""
    s = cfg.sft
    console(stats.summary())
    if any(counts.values()):
        console(
            "sft examples: "
            + ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in counts.items() if v)
            + (f" (e.g. {bad_examples[0]})" if bad_examples else "")
            + f"; conversations longer than train.seq_len={cfg.seq_len} are "
            + ("cut to it" if s.overlong == "truncate" else "dropped")
        )
    if not any_train:
        what = {PREFERENCE_KIND: "pair in preference.data", PROMPT_KIND: "prompt in rl.data",
                UNPAIRED_KIND: "unpaired example in preference.data"}.get(
            kind, "conversation in sft.data")
        raise DataError(f"no usable training {what} ({stats.summary()}); check the records and sft.format")


def _write(dir: Path, tok: Tokenizer, template, kind: str, examples: dict[str, list[Example]],
           infos: dict[str, list[dict]]) -> dict:
    """The tokenizer, the template and each split's arrays (and per-example infos) into `dir`; returns
    each split's counts for the meta file."""
    tok.save(dir / TOKENIZER_FILE)
    (dir / TEMPLATE_FILE).write_text(template.source, encoding="utf-8")
    splits = {}
    for name, exs in examples.items():
        split = SFTSplit.of(exs)
        for part, arr in (("ids", split.ids), ("mask", split.mask), ("offsets", split.offsets)):
            np.save(dir / f"{name}_{part}.npy", arr, allow_pickle=False)
        if kind in (PROMPT_KIND, PREFERENCE_KIND, UNPAIRED_KIND):
            (dir / INFO_FILE.format(split=name)).write_text(json.dumps(infos[name]), encoding="utf-8")
        splits[name] = {
            "examples": len(split),
            "tokens": int(split.offsets[-1]),
            "loss_tokens": int(sum(e.mask[1:].sum() for e in exs)),
        }
    return splits


def _meta(kind: str, tok: Tokenizer, base_vocab: int, template, splits: dict, stats: ChatStats,
          counts: dict[str, int]) -> dict:
    """The prepared dir's meta: what it holds and how it was made."""
    return {
        "kind": kind,
        "format": FORMAT,
        "lmforge_version": __version__,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        # The template's control tokens the tokenizer did not have: the model needs rows for them.
        "base_vocab": base_vocab,
        "added_tokens": list(range(base_vocab, tok.vocab_size)),
        "template": {
            "name": template.name,
            "special_tokens": template.special_tokens,
            "end_of_turn": template.end_of_turn,
            "variables": template.variables,
        },
        "splits": splits,
        "stats": {
            "files": stats.files,
            "records": stats.records,
            "skipped_records": stats.skipped,
            "skipped_examples": stats.examples,
            **counts,
        },
    }


def _build(cfg: Config, tok_path: Path, dir: Path, console: Callable[[str], object]) -> dict:
    s = cfg.sft
    kind = kind_of(cfg)
    data, val_data, val_fraction = _sources(cfg)
    tok = Tokenizer.load(tok_path)
    base_vocab = tok.vocab_size
    template = resolve_template(cfg, tok_path, tok)
    specials = tok.special_tokens()
    stats = ChatStats()
    examples: dict[str, list[Example]] = {"train": [], "val": []}
    infos: dict[str, list[dict]] = {"train": [], "val": []}
    counts = {"truncated": 0, "dropped_overlong": 0, "no_loss_tokens": 0, "bad_content": 0}
    bad_examples: list[str] = []

    # a preference pair's completions carry the loss, whatever sft.loss_on says for conversations
    loss_on = "assistant" if kind in (PREFERENCE_KIND, UNPAIRED_KIND) else s.loss_on

    def bad(where: str, e: DataError) -> None:
        """A record the template or the content checks refuse: fatal, or skipped and counted."""
        if isinstance(e, TemplateError) or s.on_bad_record == "fail":
            raise DataError(f"{where}: {e}") from None
        counts["bad_content"] += 1
        if len(bad_examples) < 5:
            bad_examples.append(f"{where}: {e}")

    limit = tok.text_budget(cfg.seq_len + 1)  # characters of a render that can reach the sequence

    def example(conv: Conversation, rendered) -> Example | None:
        """The example of one rendered conversation, fitted to the sequence length (None: skipped)."""
        try:
            if kind == PROMPT_KIND:
                ids, _ = tok.encode_chat(rendered.text)
                if len(ids) >= cfg.seq_len or not rendered.complete:  # no room left for a reply
                    counts["dropped_overlong"] += 1
                    return None
                return Example(np.asarray(ids, dtype=np.int32), np.zeros(len(ids), dtype=bool))
            ex = label_mask(conv, template, tok, loss_on, rendered)
        except DataError as e:
            bad(conv.where, e)
            return None
        fitted = fit(ex, cfg.seq_len, s.overlong)
        overlong = len(ex.ids) > cfg.seq_len or not ex.complete
        if fitted is None:
            counts["dropped_overlong" if overlong else "no_loss_tokens"] += 1
            return None
        counts["truncated"] += overlong
        return fitted

    def conversations(item) -> list[Conversation]:
        if kind == PROMPT_KIND:
            return [Conversation(item.messages, item.where)]
        if kind == UNPAIRED_KIND:
            return [item.conversation()]
        return list(item.conversations()) if kind == PREFERENCE_KIND else [item]

    def add(batch: list[tuple[object, str]]) -> None:
        """A batch of records: their conversations' contents checked, rendered in one round trip, and
        each record's examples kept (a pair whole or not at all)."""
        groups = [conversations(item) for item, _ in batch]
        checked = []
        for conv in (c for g in groups for c in g):
            try:
                check_contents(conv, specials)
                checked.append(conv)
            except DataError as e:
                bad(conv.where, e)
        try:
            rendered = template.render_batch([c.messages for c in checked], spans=kind != PROMPT_KIND,
                                             add_generation_prompt=kind == PROMPT_KIND, limit=limit,
                                             tools=[c.tools for c in checked])
        except TemplateError as e:
            raise DataError(f"{checked[e.index or 0].where}: {e}") from None
        by_conv = {id(c): r for c, r in zip(checked, rendered)}
        for (item, split), group in zip(batch, groups):
            made = [example(c, by_conv[id(c)]) if id(c) in by_conv else None for c in group]
            if any(e is None for e in made):
                continue
            examples[split].extend(made)
            if kind == PROMPT_KIND:
                infos[split].append(item.info)
            elif kind == UNPAIRED_KIND:
                infos[split].append({"label": item.desirable})
            elif kind == PREFERENCE_KIND:
                infos[split].append({"margin": item.margin})

    read = _reader(kind, s, stats)

    def split_items():
        if val_data:
            yield from ((item, "train") for item in read(data))
            yield from ((item, "val") for item in read(val_data))
        else:
            for i, item in enumerate(read(data)):
                yield item, split_of(i, cfg.run.seed, val_fraction) if val_fraction > 0 else "train"

    for batch in batches(split_items(), lambda pair: message_chars(conversations(pair[0]))):
        add(batch)
    _report(cfg, kind, stats, counts, bad_examples, bool(examples["train"]), console)
    splits = _write(dir, tok, template, kind, examples, infos)
    return _meta(kind, tok, base_vocab, template, splits, stats, counts)
