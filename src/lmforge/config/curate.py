"""The `curate` section: a corpus-cleaning pipeline (`lmforge data`) of ordered, configurable steps.

Each step is one entry of `curate.steps`, chosen by its `step` name; its other keys are typed here so
that a typo or a bad threshold fails before any document is read. Defaults follow the published
Gopher (Rae et al., 2021) and C4 (Raffel et al., 2020) rules.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from lmforge.config.section import SEED_MAX

# the largest English-language web populations (US covers all of +1: Canada, the Caribbean) and
# the two largest EU languages; numbers of every other country are still found when written
# with + and a country code, and each added region costs throughput and look-alike surface
DEFAULT_PHONE_REGIONS = ("US", "GB", "IN", "DE", "FR")


class _Step(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # as config/section.py


class NormalizeStep(_Step):
    step: Literal["normalize"] = "normalize"
    nfc: bool = Field(True, description="Unicode NFC normalisation.")
    fix_mojibake: bool = Field(True, description="Repair mojibake with ftfy.")
    strip_control: bool = Field(True, description="Remove control characters other than tab and newline.")
    whitespace: bool = Field(
        True, description="Unify line ends, no-break spaces to spaces, strip line ends, at most 2 blank "
        "lines (indentation inside lines is kept: code stays intact)."
    )


class GopherQualityStep(_Step):
    step: Literal["gopher_quality"] = "gopher_quality"
    min_words: int = Field(50, ge=0, description="Drop documents with fewer words.")
    max_words: int = Field(100_000, ge=1, description="Drop documents with more words.")
    min_mean_word_length: float = Field(3.0, ge=0, description="Drop if the mean word length is below.")
    max_mean_word_length: float = Field(10.0, gt=0, description="Drop if the mean word length is above.")
    max_symbol_word_ratio: float = Field(0.1, ge=0, description="Max ratio of '#' and '...' to words.")
    max_bullet_lines_ratio: float = Field(
        0.9, ge=0, le=1, description="Max fraction of lines starting with a bullet."
    )
    max_ellipsis_lines_ratio: float = Field(
        0.3, ge=0, le=1, description="Max fraction of lines ending in an ellipsis."
    )
    min_alpha_words_ratio: float = Field(0.8, ge=0, le=1, description="Min fraction of words with a letter.")
    min_stop_words: int = Field(
        2, ge=0, description="Min count of English stop words (the, be, to, of, and, that, have, with)."
    )


class C4QualityStep(_Step):
    step: Literal["c4_quality"] = "c4_quality"
    min_terminal_punct_lines_ratio: float = Field(
        0.12, ge=0, le=1, description='Min fraction of lines ending in terminal punctuation (. ! ? ").'
    )
    drop_boilerplate_lines: bool = Field(
        True, description="Remove lines mentioning javascript, cookies, terms of use, privacy policy."
    )
    drop_lorem_ipsum: bool = Field(True, description="Drop documents containing 'lorem ipsum'.")
    max_boilerplate_lines_ratio: float = Field(
        0.5, ge=0, le=1, description="Drop documents where more than this fraction of lines is boilerplate."
    )


class RepetitionStep(_Step):
    step: Literal["repetition"] = "repetition"
    max_dup_line_frac: float = Field(0.3, ge=0, le=1, description="Max fraction of duplicated lines.")
    max_dup_para_frac: float = Field(0.3, ge=0, le=1, description="Max fraction of duplicated paragraphs.")
    max_dup_line_char_frac: float = Field(
        0.2, ge=0, le=1, description="Max char fraction in duplicated lines."
    )
    max_dup_para_char_frac: float = Field(
        0.2, ge=0, le=1, description="Max char fraction in duplicated paragraphs."
    )
    max_top_ngram_char_frac: dict[int, float] = Field(
        default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16},
        description="n -> max char fraction covered by the most frequent word n-gram.",
    )
    max_dup_ngram_char_frac: dict[int, float] = Field(
        default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10},
        description="n -> max char fraction covered by duplicated word n-grams.",
    )


class HarmfulStep(_Step):
    step: Literal["harmful"] = "harmful"
    lists: list[Literal["ldnoobw-en"]] = Field(
        default_factory=lambda: ["ldnoobw-en"], description="Shipped block lists matched besides blocklist "
        "and blocklist_files: ldnoobw-en is the List of Dirty, Naughty, Obscene and Otherwise Bad Words, "
        "English (403 entries, CC BY 4.0; C4's bad-words filter). [] to match only your own entries; a step "
        "with no entry at all is refused (it would remove nothing)."
    )
    blocklist: list[str] = Field(
        default_factory=list, description="Words and phrases (matched on word boundaries)."
    )
    blocklist_files: list[str] = Field(
        default_factory=list, description="Files with one word or phrase per line."
    )
    max_hits: int = Field(0, ge=0, description="Drop documents with more than this many block-list matches.")
    max_hit_ratio: float | None = Field(
        None, ge=0, description="... or with more matches per word than this."
    )


class PiiStep(_Step):
    step: Literal["pii"] = "pii"
    types: list[Literal["email", "phone", "ipv4", "ipv6", "credit_card", "ssn", "iban", "secret"]] = Field(
        default_factory=lambda: ["email", "phone", "ipv4", "ipv6", "credit_card", "ssn", "iban", "secret"],
        description="PII types to redact, each replaced by a typed placeholder such as <EMAIL>.",
    )
    phone_regions: list[str] = Field(
        default_factory=lambda: list(DEFAULT_PHONE_REGIONS),
        description="Regions whose national phone formats (no +country code) are redacted, as ISO "
        "3166-1 alpha-2 codes; numbers written with + and a country code are redacted for any region.",
    )

    @field_validator("phone_regions")
    @classmethod
    def _known_regions(cls, regions: list[str]) -> list[str]:
        import phonenumbers  # here, not at the top: loading a config stays light

        regions = [r.upper() for r in regions]
        bad = [r for r in regions if r not in phonenumbers.SUPPORTED_REGIONS]
        if bad:
            hint = " (the United Kingdom is GB)" if "UK" in bad else ""
            raise ValueError(
                f"unknown phone region(s) {', '.join(map(repr, bad))}{hint}: use ISO 3166-1 alpha-2 codes "
                "such as US, GB, DE, FR, IN"
            )
        return list(dict.fromkeys(regions))


class LanguageStep(_Step):
    step: Literal["language"] = "language"
    languages: list[str] = Field(default_factory=lambda: ["en"], description="Languages to keep (ISO 639-1).")
    min_score: float = Field(
        0.5, ge=0, le=1,
        description="Min share of the document's recognised stop words that belong to a kept language.",
    )


class LengthStep(_Step):
    step: Literal["length"] = "length"
    min_chars: int = Field(0, ge=0, description="Drop documents shorter than this many characters.")
    max_chars: int | None = Field(None, ge=1, description="Drop documents longer than this many characters.")
    min_lines: int = Field(0, ge=0, description="Drop documents with fewer lines.")


class DecontaminateStep(_Step):
    step: Literal["decontaminate"] = "decontaminate"
    eval_files: list[str] = Field(description="Evaluation sets (text / JSONL files) to protect.")
    ngram: int = Field(
        13, ge=3, description="Drop documents sharing a word n-gram of this size with an eval set."
    )


class ExactDedupStep(_Step):
    step: Literal["exact_dedup"] = "exact_dedup"
    normalize: bool = Field(True, description="Hash lower-cased text with whitespace collapsed.")


class MinHashDedupStep(_Step):
    step: Literal["minhash_dedup"] = "minhash_dedup"
    threshold: float = Field(
        0.8, gt=0, le=1, description="Jaccard similarity at which documents are duplicates."
    )
    ngram: int = Field(5, ge=1, description="Word n-gram size of the shingles.")
    num_perm: int = Field(128, ge=16, description="MinHash permutations (bands x rows).")
    bands: int | None = Field(None, ge=1, description="LSH bands (None: chosen from threshold and num_perm).")
    seed: int = Field(1, ge=0, le=SEED_MAX, description="Seed of the hash permutations.")


CurateStep = Annotated[
    NormalizeStep
    | GopherQualityStep
    | C4QualityStep
    | RepetitionStep
    | HarmfulStep
    | PiiStep
    | LanguageStep
    | LengthStep
    | DecontaminateStep
    | ExactDedupStep
    | MinHashDedupStep,
    Field(discriminator="step"),
]


class CurateConfig(_Step):
    inputs: list[str] = Field(
        default_factory=list,
        description="Folders of .txt/.md/.jsonl/.parquet files, single files, or datasets saved with "
        "`save_to_disk` (prefix 'hf:'), or 'builtin:python'.",
    )
    output_dir: str = Field(
        "data/curated", description="Where cleaned shards, removed.jsonl and the report go."
    )
    text_key: str = Field("text", description="Text field of JSONL / Parquet records.")
    id_key: str = Field("id", description="Id field of records (else source path + record number).")
    output_format: Literal["jsonl", "parquet"] = Field("jsonl", description="Format of the cleaned shards.")
    docs_per_shard: int = Field(10_000, ge=1, description="Documents per input work unit and output shard.")
    workers: int = Field(2, ge=1, description="Parallel worker processes.")
    engine: Literal["local", "ray"] = Field("local", description="Run workers locally or on a Ray cluster.")
    on_bad_input: Literal["skip", "fail"] = Field(
        "skip",
        description="Non-UTF-8 or binary files, broken JSON lines: skip and count, or fail naming file:line.",
    )
    max_line_chars: int = Field(1_000_000, ge=1, description="Lines longer than this are bad input.")
    examples_per_reason: int = Field(
        3, ge=0, description="Example snippets kept per removal reason in the report."
    )
    strictness_sweep: list[float] = Field(
        default_factory=lambda: [0.5, 0.75, 1.0, 1.25, 1.5],
        description="Multipliers of the filter thresholds for the report's strictness trade-off curve.",
    )
    steps: list[CurateStep] = Field(
        default_factory=lambda: [
            NormalizeStep(),
            GopherQualityStep(),
            RepetitionStep(),
            PiiStep(),
            ExactDedupStep(),
            MinHashDedupStep(),
        ],
        description="Ordered pipeline steps.",
    )
