"""`language`: keep documents written in the configured languages.

A simple, dependency-free, configurable rule rather than a trained classifier: each supported
language has a profile of its most common function words. A document's share for a language is the
fraction of its recognised stop words (words in any profile) that belong to that language's profile;
a word shared by several languages ("de", "in", "a") counts for each of them. The language with the
largest share is detected if that share is at least `min_score` and the document uses at least
MIN_DISTINCT different stop words of it (so that "y" and "a" as variable names in code do not make
it Spanish); else the document is "unknown".
Documents whose detected language is not in `languages` are dropped with reason
"language:<detected>" (e.g. "language:de", "language:unknown").

Documents with fewer than MIN_WORDS words are kept unjudged: a title or a one-line snippet holds
too few function words for the shares to mean anything, and the length/quality steps exist for them.
Text in a script without a profile (Cyrillic, CJK, ...) and code without prose contain no recognised
stop words and are "unknown". A trained classifier (fastText lid.176, GlotLID) can later replace
`detect` behind the same config entry.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace

from lmforge.config.curate import LanguageStep
from lmforge.data.curate.doc import Doc
from lmforge.data.curate.step import MapStep

MIN_WORDS = 20
MIN_DISTINCT = 3  # distinct stop words of the best language needed to name it
_LETTERS_RE = re.compile(r"[^\W\d_]+")  # apostrophes split words: "l'homme" -> "l", "homme"

PROFILES: dict[str, frozenset[str]] = {
    lang: frozenset(words.split())
    for lang, words in {
        "en": """the of and to a in is it you that he was for on are with as i his they be at one
            have this from or had by not but what some we can out other were all there when up use your
            how said an each she which do their time if will way about many then them would like so
            these her make him has more could who than been its also our into just only those very
            after should where through me us because such""",
        "de": """der die und in den von zu das mit sich des auf für ist im dem nicht ein eine als
            auch es an werden aus er hat dass sie nach wird bei einer um am sind noch wie einem über
            einen so zum war haben nur oder aber vor zur bis mehr durch man sein wurde sei ihr ich wir
            kann können diese dieser wenn schon was unter gegen ihre seine wieder immer""",
        "fr": """le la les de des du et en un une est que qui dans pour pas sur au ne se ce il elle
            a par plus sont avec son sa ses ils on mais ou comme nous vous je été être aux leur cette
            tout fait sans peut aussi même bien était très y l d qu c où lui ces leurs entre""",
        "es": """de la que el en y a los del se las por un para con no una su al lo como más pero
            sus le ya o este porque esta entre cuando muy sin sobre también me hasta hay donde quien
            desde todo nos durante todos uno les ni contra otros ese eso ante ellos e esto antes
            algunos qué unos yo otro otras otra él tanto esa estos mucho nada muchos poco ella es son
            fue ha era está""",
        "it": """di e il la che è per un in del non una a i le si da con sono al della dei alla gli
            lo come ma più anche nel delle ha se ci o questo su ne loro dal nella tra cui essere stato
            era mi tutto molto hanno fatto quando sua suo suoi sue questa perché dopo l all dell degli
            nei sul""",
        "pt": """de a o que e do da em um para é com não uma os no se na por mais as dos como mas
            foi ao ele das tem à seu sua ou ser quando muito há nos já está eu também só pelo pela até
            isso ela entre era depois sem mesmo aos ter seus quem nas me esse eles estão você tinha
            foram essa num nem suas meu às minha têm numa pelos elas havia seja qual será nós""",
        "nl": """de en van het een in is dat op te zijn voor met die niet aan er om ook als bij of
            uit nog wat door naar maar dan over kan hij worden wordt zo tot zich meer al ze we deze
            heeft was hebben dit geen wel ik u je heb moet zal veel werd onder tegen omdat waar hun""",
    }.items()
}
_ANY_PROFILE = frozenset().union(*PROFILES.values())


def language_shares(text: str) -> tuple[int, dict[str, float], dict[str, int]]:
    """(number of words, language -> share of the recognised stop words in its profile,
    language -> number of distinct stop words of its profile in `text`)."""
    words = _LETTERS_RE.findall(text.lower())
    counts = Counter(words)
    recognised = counts.keys() & _ANY_PROFILE
    total = sum(counts[w] for w in recognised)
    shares, distinct = {}, {}
    for lang, profile in PROFILES.items():
        mine = recognised & profile
        shares[lang] = sum(counts[w] for w in mine) / total if total else 0.0
        distinct[lang] = len(mine)
    return len(words), shares, distinct


class Step(MapStep):
    """Stop-word-profile language identification; see the module docstring for the rule."""

    name = "language"
    cfg: LanguageStep

    def __init__(self, cfg: LanguageStep) -> None:
        super().__init__(cfg)
        unknown = [lang for lang in cfg.languages if lang not in PROFILES]
        if unknown:
            raise ValueError(
                f"curate.steps[language].languages: no stop-word profile for {unknown}; "
                f"supported: {sorted(PROFILES)}"
            )

    def detect(self, text: str) -> tuple[str | None, float]:
        """(the detected language, "unknown", or None for too short a text; the best share)."""
        n_words, shares, distinct = language_shares(text)
        if n_words < MIN_WORDS:
            return None, 0.0
        best = max(shares, key=shares.__getitem__)  # ties: the first profile (dict order)
        share = shares[best]
        sure = share > 0 and share >= self.cfg.min_score and distinct[best] >= MIN_DISTINCT
        return (best if sure else "unknown"), share

    def apply(self, doc: Doc) -> tuple[Doc | None, str | None]:
        lang, _ = self.detect(doc.text)
        if lang is None:
            return doc, None
        if lang not in self.cfg.languages:
            return None, f"language:{lang}"
        return replace(doc, meta={**doc.meta, "language": lang}), None

    def score(self, doc: Doc) -> dict[str, float]:
        _, shares, _ = language_shares(doc.text)
        best = max(shares, key=shares.__getitem__)
        kept_share = shares[best] if best in self.cfg.languages else 0.0
        return {"language_score": kept_share, **{f"share_{lang}": s for lang, s in shares.items()}}
