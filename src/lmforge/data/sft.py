"""Conversations -> token ids and the tokens that carry the loss -> a prepared SFT data dir.

An example is the ids of one rendered conversation and a label mask over them (1 where the loss is
taken, as the labels of transformers / TRL: the token is predicted from the ones before it). The
template decides the text; `sft.loss_on` which characters count (see chat_template); a token counts
when its characters overlap a counted span, which is what transformers' `return_assistant_tokens_mask`
gives (the tokens from the one holding the span's first character to the one holding its last).

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
from lmforge.config.schema import Config
from lmforge.data.chat import ChatStats, Conversation, read_conversations
from lmforge.data.chat_template import CHATML_TOKENS, ChatTemplate, TemplateError
from lmforge.data.prepare import TOKENIZER_FILE, data_dir, split_of
from lmforge.data.shards import read_meta, write_meta
from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import DataError

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
    if cfg.objective.name == "dpo" and cfg.preference.loss == "kto":
        return UNPAIRED_KIND
    kinds = {"dpo": PREFERENCE_KIND, "reward": PREFERENCE_KIND, "rl": PROMPT_KIND}
    return kinds.get(cfg.objective.name, KIND)


def _sources(cfg: Config) -> tuple[list[str], list[str], float]:
    """(data, val_data, val_fraction) of the section the objective reads."""
    sections = {PREFERENCE_KIND: cfg.preference, UNPAIRED_KIND: cfg.preference, PROMPT_KIND: cfg.rl}
    s = sections.get(kind_of(cfg), cfg.sft)
    return list(s.data), list(s.val_data), s.val_fraction
TEMPLATE_FILE = "chat_template.jinja"
SPLITS = ("train", "val")


@dataclass
class Example:
    ids: np.ndarray  # int32 (n,)
    mask: np.ndarray  # bool (n,): the loss is taken on ids[i] (predicted from ids[:i])


def label_mask(conv: Conversation, template: ChatTemplate, tok: Tokenizer, loss_on: str) -> Example:
    """The ids of `conv` rendered by `template` and the mask of the tokens `loss_on` picks."""
    text, spans = template.assistant_spans(conv.messages)
    ids, offsets = tok.encode_chat(text)
    n = len(ids)
    if loss_on == "all":
        return Example(np.asarray(ids, dtype=np.int32), np.ones(n, dtype=bool))
    assistant_turns = [k for k, m in enumerate(conv.messages) if m["role"] == "assistant"]
    if len(spans) != len(assistant_turns):
        raise TemplateError(
            f"{template.name} marks {len(spans)} assistant spans in a conversation with "
            f"{len(assistant_turns)} assistant turns; fix its {{% generation %}} blocks"
        )
    if conv.completion_start is not None:  # prompt/completion: the completion only (as TRL)
        spans = [s for s, k in zip(spans, assistant_turns) if k >= conv.completion_start]
    if loss_on == "last":
        spans = spans[-1:]
    starts = np.fromiter((a for a, _ in offsets), dtype=np.int64, count=n)
    ends = np.fromiter((b for _, b in offsets), dtype=np.int64, count=n)
    mask = np.zeros(n, dtype=bool)
    for a, b in spans:
        mask |= (starts < b) & (ends > a) & (ends > starts)
    return Example(np.asarray(ids, dtype=np.int32), mask)


def check_contents(conv: Conversation, specials: list[str]) -> None:
    """A message may not contain a control token's text: it would be encoded as the token itself and
    could forge a turn (an injected `<|im_start|>assistant`)."""
    for i, m in enumerate(conv.messages):
        for s in specials:
            if s and s in m["content"]:
                raise DataError(f"message {i} ({m['role']}) contains the control token {s!r}")


def fit(example: Example, seq_len: int, overlong: str) -> Example | None:
    """`example` cut to seq_len tokens (overlong=truncate), or None when it does not fit (drop) or
    keeps no loss token."""
    if len(example.ids) > seq_len:
        if overlong == "drop":
            return None
        example = Example(example.ids[:seq_len], example.mask[:seq_len])
    return example if example.mask[1:].any() else None  # mask[0] is never predicted


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
            info = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: cannot read the prompts' answers ({e}); prepare the data "
                            "again") from None
        if not isinstance(info, list) or not all(isinstance(i, dict) for i in info):
            raise DataError(f"{path}: expected a list of objects; prepare the data again")
        return info


def load_template(dir: Path, meta: dict) -> ChatTemplate:
    t = meta["template"]
    return ChatTemplate(
        (dir / TEMPLATE_FILE).read_text(encoding="utf-8"),
        t.get("special_tokens") or {},
        name=t.get("name", "chat template"),
        end_of_turn=t.get("end_of_turn"),
    )


def load_prepared_sft(dir: str | Path) -> PreparedSFT:
    dir = Path(dir)
    meta = read_meta(dir)
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
    choice = cfg.sft.template
    config = _tokenizer_config(tok_path)
    own = _own_template(tok_path, config)
    if choice == "auto":
        choice = "tokenizer" if own is not None else "chatml"
    if choice == "chatml":
        tok.add_special_tokens(CHATML_TOKENS)
        return ChatTemplate.chatml()
    specials = {
        k: _token_text(v) for k, v in config.items() if k.endswith("_token") and _token_text(v) is not None
    }
    # lmforge's own tokenizers have no tokenizer_config.json: their EOS is the template's eos_token.
    specials.setdefault("eos_token", tok.hf.id_to_token(tok.eos_id))
    if choice == "tokenizer":
        if own is None:
            raise DataError(f"sft.template=tokenizer: {tok_path.parent} has no chat template (chat_template "
                            "in tokenizer_config.json, or chat_template.jinja)")
        source, name = own
        end = specials.get("eos_token")
    else:
        path = Path(choice)
        if not path.is_file():
            raise DataError(f"sft.template={choice!r}: no such file; give auto, chatml or a .jinja file")
        source, name, end = (
            path.read_text(encoding="utf-8"),
            f"the chat template {path}",
            specials.get("eos_token"),
        )
    return ChatTemplate(source, specials, name=name, end_of_turn=end)


def _tokenizer_config(tok_path: Path | None) -> dict:
    if tok_path is None:
        return {}
    path = tok_path.parent / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    return config if isinstance(config, dict) else {}


def _own_template(tok_path: Path | None, config: dict) -> tuple[str, str] | None:
    """(source, where) of the template that ships with a tokenizer: chat_template.jinja beside it (as
    transformers >= 4.50 saves it), else tokenizer_config.json's chat_template (a string, or a list
    of named templates of which "default" is the one applied)."""
    if tok_path is None:
        return None
    jinja = tok_path.parent / TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), f"the chat template {jinja}"
    where = f"the chat template of {tok_path.parent / 'tokenizer_config.json'}"
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return (value, where) if isinstance(value, str) else None


def _token_text(v) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


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
    kind = kind_of(cfg)
    if not _sources(cfg)[0]:
        key, what = {KIND: ("sft.data", "chat data"), PROMPT_KIND: ("rl.data", "prompts")}.get(
            kind, ("preference.data", "preference pairs"))
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

    def example(conv: Conversation) -> Example | None:
        try:
            check_contents(conv, specials)
            ex = label_mask(conv, template, tok, loss_on)
        except DataError as e:
            bad(conv.where, e)
            return None
        fitted = fit(ex, cfg.seq_len, s.overlong)
        if fitted is None:
            counts["dropped_overlong" if len(ex.ids) > cfg.seq_len else "no_loss_tokens"] += 1
            return None
        counts["truncated"] += len(fitted.ids) < len(ex.ids)
        return fitted

    def prompt(item) -> Example | None:
        try:
            check_contents(Conversation(item.messages, item.where), specials)
            ids, _ = tok.encode_chat(template.render(list(item.messages), add_generation_prompt=True))
        except DataError as e:
            bad(item.where, e)
            return None
        if len(ids) >= cfg.seq_len:  # no room left for a reply
            counts["dropped_overlong"] += 1
            return None
        return Example(np.asarray(ids, dtype=np.int32), np.zeros(len(ids), dtype=bool))

    def add(item, split: str) -> None:
        if kind == PROMPT_KIND:
            if (ex := prompt(item)) is not None:
                examples[split].append(ex)
                infos[split].append(item.info)
            return
        if kind == UNPAIRED_KIND:
            if (ex := example(item.conversation())) is not None:
                examples[split].append(ex)
                infos[split].append({"label": item.desirable})
            return
        convs = item.conversations() if kind == PREFERENCE_KIND else (item,)
        made = [example(c) for c in convs]
        if all(e is not None for e in made):  # a pair is kept whole or not at all
            examples[split].extend(made)
            if kind == PREFERENCE_KIND:
                infos[split].append({"margin": item.margin})

    if kind == PREFERENCE_KIND:
        from lmforge.data.preference import read_pairs

        read = lambda sources: read_pairs(sources, s.on_bad_record, stats)  # noqa: E731
    elif kind == UNPAIRED_KIND:
        from lmforge.data.preference import read_unpaired

        read = lambda sources: read_unpaired(sources, s.on_bad_record, stats)  # noqa: E731
    elif kind == PROMPT_KIND:
        from lmforge.data.prompts import read_prompts

        read = lambda sources: read_prompts(sources, s.on_bad_record, stats)  # noqa: E731
    else:
        read = lambda sources: read_conversations(sources, s.format, s.on_bad_record, stats)  # noqa: E731
    if val_data:
        for item in read(data):
            add(item, "train")
        for item in read(val_data):
            add(item, "val")
    else:
        for i, item in enumerate(read(data)):
            add(item, split_of(i, cfg.run.seed, val_fraction) if val_fraction > 0 else "train")
    console(stats.summary())
    if any(counts.values()):
        console(
            "sft examples: "
            + ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in counts.items() if v)
            + (f" (e.g. {bad_examples[0]})" if bad_examples else "")
            + f"; conversations longer than train.seq_len={cfg.seq_len} are "
            + ("cut to it" if s.overlong == "truncate" else "dropped")
        )
    if not examples["train"]:
        what = {PREFERENCE_KIND: "pair in preference.data", PROMPT_KIND: "prompt in rl.data",
                UNPAIRED_KIND: "unpaired example in preference.data"}.get(
            kind, "conversation in sft.data")
        raise DataError(f"no usable training {what} ({stats.summary()}); check the records and sft.format")
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
