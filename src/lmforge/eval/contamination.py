"""Contamination report: how much of each evaluation set a run saw in its training data.

N-grams are those of the curation step's decontamination (`data/curate/steps/decontaminate.py`):
word n-grams (13 by default) over lower-cased runs of word characters, so case, punctuation and
spacing never hide an overlap, hashed to stable 64-bit values by `dedup.ShingleHasher`. A document of
fewer than `ngram` words has no n-gram: it is reported as too short, never as clean or contaminated.

The training data is read from the run's resolved config (`training_texts`) exactly as the run read
it: pretraining documents of `data.sources` (with `data.max_chars`, skipping the validation split),
or the records of the fine-tuning section the objective reads (sft / preference / rl), every string
of a record a separate text, as decontamination reads eval files. `contamination_report` indexes the
eval side (small) and streams the training texts past it, so memory grows with the eval sets, not
with the corpus; `NgramIndex` also indexes a corpus once to check many eval sets against it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from lmforge.config.methods import method_facts
from lmforge.config.schema import Config
from lmforge.data.chat import ChatStats, parse_sources, to_conversation
from lmforge.data.curate.dedup import ShingleHasher, words
from lmforge.data.curate.steps.decontaminate import _strings
from lmforge.data.preference import to_pair, to_unpaired
from lmforge.data.prepare import split_of
from lmforge.data.prompts import to_prompt
from lmforge.data.sft import PREFERENCE_KIND, PROMPT_KIND, UNPAIRED_KIND, kind_of
from lmforge.data.sources import SourceStats, iter_documents
from lmforge.errors import DataError

DEFAULT_NGRAM = 13  # the GPT-3 paper's rule, and curate's decontaminate default


@dataclass
class TrainingStats:
    """What `training_texts` read; filled in while it runs."""

    section: str = ""  # the config key the texts come from: data.sources, sft.data, ...
    sources: list[str] = field(default_factory=list)
    documents: int = 0  # pretraining documents, or fine-tuning records, the run trained on
    texts: int = 0  # texts yielded (a record gives one per string)
    chars: int = 0
    held_out: int = 0  # documents / records of the validation split, not read as training data
    skipped_bad: int = 0  # records the run's reader skips (not a conversation, pair or prompt)
    data_max_chars_hit: bool = False  # the run itself stopped reading at data.max_chars (so did we)
    budget_hit: bool = False  # stopped at the `max_chars` budget: the report covers a prefix only

    def summary(self) -> str:
        """One line for the console."""
        line = (
            f"{self.section}: {self.documents:,} training documents, {self.chars:,} chars"
            f" ({self.held_out:,} held out for validation)"
        )
        if self.skipped_bad:
            line += f"; skipped {self.skipped_bad:,} bad records"
        if self.data_max_chars_hit:
            line += "; stopped at data.max_chars, as the run did"
        if self.budget_hit:
            line += "; stopped at the max_chars budget: overlap is a lower bound"
        return line

    def to_dict(self) -> dict:
        return asdict(self)


def training_texts(
    cfg: Config, max_chars: int | None = None, stats: TrainingStats | None = None
) -> Iterator[str]:
    """The texts the run of `cfg` trained on, in its reading order; `stats` says what was read.

    causal_lm: the train-split documents of data.sources (lmforge's source readers, data.max_chars
    included). sft / dpo / reward / rl: the records of sft.data / preference.data / rl.data that the
    run's reader accepts, minus the validation split (`*.val_fraction`; all of them when `*.val_data`
    is given), each string in a record a separate text. Stops after `max_chars` characters (the last
    text cut to fit; `stats.budget_hit`). Raises DataError when the section names no data.
    """
    stats = stats if stats is not None else TrainingStats()
    if max_chars is not None and max_chars < 1:
        raise ValueError(f"max_chars must be >= 1 or None, got {max_chars}")
    texts = _finetuning(cfg, stats) if method_facts(cfg).chat else _pretraining(cfg, stats)
    for text in texts:
        if max_chars is not None and len(text) >= max_chars - stats.chars:
            text = text[: max_chars - stats.chars]
            stats.budget_hit = True
        stats.texts += 1
        stats.chars += len(text)
        yield text
        if stats.budget_hit:
            return


def _pretraining(cfg: Config, stats: TrainingStats) -> Iterator[str]:
    d = cfg.data
    stats.section, stats.sources = "data.sources", list(d.source_paths)
    if not d.sources:
        raise DataError("data.sources is empty: the run names no training data to check against")
    source_stats = SourceStats()
    for i, doc in enumerate(iter_documents(d, source_stats)):
        # as `lmforge prepare` splits them (data.val_sources: every document of data.sources trains)
        if not d.val_sources and split_of(i, cfg.run.seed, d.val_fraction) != "train":
            stats.held_out += 1
            continue
        stats.documents += 1
        yield doc
    stats.data_max_chars_hit = source_stats.truncated


def _finetuning(cfg: Config, stats: TrainingStats) -> Iterator[str]:
    name = method_facts(cfg).data_section
    section = getattr(cfg, name)
    parse = {PREFERENCE_KIND: to_pair, UNPAIRED_KIND: to_unpaired, PROMPT_KIND: to_prompt}.get(
        kind_of(cfg), lambda record, where: to_conversation(record, where, cfg.sft.format))
    stats.section, stats.sources = f"{name}.data", list(section.data)
    if not section.data:
        raise DataError(
            f"{name}.data is empty: the run (objective {cfg.objective.name}) names no training "
            "data to check against"
        )

    def accepted(record: Any, where: str) -> Any:
        parse(record, where)  # BadRecord for what the run's reader skips (and so never trained on)
        return record

    # the split of `prepare_sft`: accepted record i is held out by the run's seed
    split = not section.val_data and section.val_fraction > 0
    chat = ChatStats()
    for i, record in enumerate(parse_sources(list(section.data), accepted, on_bad="skip", stats=chat)):
        stats.skipped_bad = chat.skipped
        if split and split_of(i, cfg.run.seed, section.val_fraction) != "train":
            stats.held_out += 1
            continue
        stats.documents += 1
        yield from _strings(record)
    stats.skipped_bad = chat.skipped


# -- n-gram overlap ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DocOverlap:
    """One document's n-grams (positions, a repeated n-gram counted each time) and how many were found."""

    ngrams: int
    found: int

    @property
    def too_short(self) -> bool:
        """Fewer words than the n-gram size: neither clean nor contaminated."""
        return self.ngrams == 0

    @property
    def contaminated(self) -> bool:
        return self.found > 0

    @property
    def fraction(self) -> float:
        """Fraction of the document's n-grams found (0.0 for a too-short document)."""
        return self.found / self.ngrams if self.ngrams else 0.0


class NgramIndex:
    """The distinct word n-grams of some texts: one sorted array of 64-bit hashes, 8 bytes each.

    Texts are hashed in chunks of `chunk` n-grams, each deduplicated as it fills, so building streams a
    corpus with memory for its distinct n-grams plus one chunk (and a merge of the two at the end).
    """

    def __init__(self, texts: Iterable[str] = (), ngram: int = DEFAULT_NGRAM, chunk: int = 1 << 23) -> None:
        self.hasher = ShingleHasher(ngram)  # ValueError for ngram < 1
        parts: list[np.ndarray] = []
        buf: list[np.ndarray] = []
        n = 0
        for text in texts:
            h = self.hashes(text)
            buf.append(h)
            n += len(h)
            if n >= chunk:
                parts.append(np.unique(np.concatenate(buf)))
                buf, n = [], 0
        if buf:
            parts.append(np.unique(np.concatenate(buf)))
        self.grams = np.unique(np.concatenate(parts)) if parts else np.empty(0, dtype=np.uint64)

    @property
    def ngram(self) -> int:
        return self.hasher.ngram

    def __len__(self) -> int:
        return len(self.grams)

    def hashes(self, text: str) -> np.ndarray:
        """The text's n-gram hashes in order (none for a text of fewer than `ngram` words)."""
        return self.hasher(words(text), short_as_one=False)

    def find(self, hashes: np.ndarray) -> np.ndarray:
        """Position of each hash in `grams` (int64), -1 where it is not held."""
        if not len(self.grams) or not len(hashes):
            return np.full(len(hashes), -1, dtype=np.int64)
        pos = np.searchsorted(self.grams, hashes)
        pos[pos == len(self.grams)] = 0
        return np.where(self.grams[pos] == hashes, pos, -1)

    def overlap(self, texts: Iterable[str]) -> list[DocOverlap]:
        """Per text, its n-grams and how many of them this index holds."""
        out = []
        for text in texts:
            h = self.hashes(text)
            out.append(DocOverlap(len(h), int(np.count_nonzero(self.find(h) >= 0))))
        return out


def contamination_report(
    eval_docs: dict[str, list[str]], train_texts: Iterable[str], ngram: int = DEFAULT_NGRAM
) -> dict[str, dict]:
    """Per task of `eval_docs` (task -> the text of each document), its overlap with `train_texts`.

    Each task's entry: documents; too_short (fewer than `ngram` words: not counted below); checked
    (the others); contaminated (checked documents sharing at least one n-gram with the training
    texts), contaminated_fraction (of checked, None when none was), contaminated_docs (their indices);
    mean_overlap (mean over checked documents of the fraction of their n-grams found, None when none);
    ngrams and ngrams_found (n-gram positions over all documents). `train_texts` is read once,
    streaming, against an index of the eval n-grams.
    """
    index = NgramIndex((text for docs in eval_docs.values() for text in docs), ngram)
    seen = np.zeros(len(index), dtype=bool)
    if len(index):
        for text in train_texts:
            pos = index.find(index.hashes(text))
            seen[pos[pos >= 0]] = True
    report = {}
    for task, docs in eval_docs.items():
        per = []
        for text in docs:
            pos = index.find(index.hashes(text))
            assert (pos >= 0).all()  # every eval n-gram is in the index it was built into
            per.append(DocOverlap(len(pos), int(np.count_nonzero(seen[pos]))))
        report[task] = _task_stats(per, ngram)
    return report


def _task_stats(per: list[DocOverlap], ngram: int) -> dict:
    checked = [d for d in per if not d.too_short]
    bad = [i for i, d in enumerate(per) if d.contaminated]
    return {
        "ngram": ngram,
        "documents": len(per),
        "too_short": len(per) - len(checked),
        "checked": len(checked),
        "contaminated": len(bad),
        "contaminated_fraction": len(bad) / len(checked) if checked else None,
        "contaminated_docs": bad,
        "mean_overlap": float(np.mean([d.fraction for d in checked])) if checked else None,
        "ngrams": sum(d.ngrams for d in per),
        "ngrams_found": sum(d.found for d in per),
    }


def run_contamination(
    cfg: Config, eval_docs: dict[str, list[str]], ngram: int = DEFAULT_NGRAM, max_chars: int | None = None
) -> dict:
    """`contamination_report` of `eval_docs` against the training data of the run of `cfg`, with what
    was read: {"ngram", "training": TrainingStats as a dict, "tasks": the report}."""
    stats = TrainingStats()
    tasks = contamination_report(eval_docs, training_texts(cfg, max_chars, stats), ngram)
    return {"ngram": ngram, "training": stats.to_dict(), "tasks": tasks}
