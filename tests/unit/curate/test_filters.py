"""The curation map steps: normalize, gopher_quality, c4_quality, repetition, harmful, language, length.

Each step sees real prose it must keep and crafted bad documents it must drop with the exact reason,
with thresholds probed at the boundary (a value equal to a limit passes).
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from lmforge.config.curate import (
    C4QualityStep,
    GopherQualityStep,
    HarmfulStep,
    LanguageStep,
    LengthStep,
    NormalizeStep,
    RepetitionStep,
)
from lmforge.data.curate.doc import Doc
from lmforge.data.curate.step import build_map_step
from lmforge.data.curate.steps.repetition import ngram_repetition
from lmforge.data.curate.text import count_alpha_words, ngrams, paragraphs, split_words

DATA = Path(__file__).resolve().parents[2] / "data" / "curate"
EN = (DATA / "en_prose.txt").read_text(encoding="utf-8").strip()
DE = (DATA / "de_prose.txt").read_text(encoding="utf-8").strip()
FR = (DATA / "fr_prose.txt").read_text(encoding="utf-8").strip()
EN_WORDS = EN.split()


def run(cfg, text: str):
    """(output text or None, reason) of the step built from `cfg` on one document."""
    out, reason = build_map_step(cfg).apply(Doc("d", text))
    return (None if out is None else out.text), reason


# --------------------------------------------------------------------------- shared


@pytest.mark.parametrize(
    "cfg",
    [NormalizeStep(), GopherQualityStep(), C4QualityStep(), RepetitionStep(), HarmfulStep(blocklist=["x"]),
     LanguageStep(), LengthStep()],
)
def test_steps_keep_clean_prose_unchanged_and_are_deterministic(cfg):
    step = build_map_step(cfg)
    assert step.name == cfg.step
    doc = Doc("d", EN, {"source": "s"})
    out1, reason1 = step.apply(doc)
    out2, reason2 = step.apply(doc)
    assert reason1 is None and reason2 is None
    assert out1.text == EN and out1 == out2 and out1.id == "d" and out1.meta["source"] == "s"
    assert step.score(doc) == step.score(doc)


def test_text_helpers():
    assert split_words("(Hello), world... don't 3.14 -- # e.g. «quoted»") == [
        "Hello", "world", "don't", "3.14", "e.g", "quoted"]
    assert count_alpha_words(["abc", "123", "a1", "3.14", "é"]) == 3
    assert paragraphs("\n\na\nb\n\n  \n\nc\n") == ["a\nb", "c"]
    assert ngrams(["a", "b", "c"], 2) == [("a", "b"), ("b", "c")]
    assert ngrams(["a"], 2) == []


# --------------------------------------------------------------------------- normalize


def test_normalize_repairs_mojibake_and_keeps_typography():
    step = build_map_step(NormalizeStep())
    out, reason = step.apply(Doc("d", "Le cafÃ© est ouvert. Les â€œbonsâ€\x9d prix."))
    assert reason is None and out.text == "Le café est ouvert. Les “bons” prix."
    # Well-formed typography, HTML entities, full-width CJK punctuation are not "fixed".
    fine = "“Quoted” — it’s 5–7 € &amp; 東京、ＡＢＣ。"
    assert step.apply(Doc("d", fine))[0].text == fine
    # PDF ligatures are split back into letters.
    assert step.apply(Doc("d", "a \ufb01le")) == (Doc("d", "a file"), None)
    assert step.take_counts() == {"mojibake_fixed": 2}
    assert step.take_counts() == {}


def test_mojibake_fixer_equals_ftfy_on_whole_text():
    ftfy = pytest.importorskip("ftfy")
    from lmforge.data.curate.steps.normalize import MojibakeFixer

    fixer = MojibakeFixer()
    samples = [EN, DE, FR, "Le cafÃ© â€œbonâ€\x9d\nascii line\n\x1b[1mbold\x1b[0m Ã©tÃ©\n",
               "voilÃ le travail\r\nÃ©\n", "РџСЂРёРІРµС‚ мир\nok", "a \ufb01le\n\x93quote\x94 • item"]
    for text in samples:
        assert fixer(text) == ftfy.fix_text(text, fixer.config)
    assert fixer("РџСЂРёРІРµС‚ мир") == "Привет мир"


def test_normalize_nfc_control_chars_and_terminal_escapes():
    step = build_map_step(NormalizeStep())
    assert step.apply(Doc("d", "Cafe\u0301 au lait"))[0].text == "Café au lait"
    assert step.apply(Doc("d", "a\x00b\x07c\td\x7fe\ufefff\nnext"))[0].text == "abc\tdef\nnext"
    assert step.apply(Doc("d", "\x1b[31mred\x1b[0m text"))[0].text == "red text"
    assert step.take_counts() == {"nfc": 1, "control_removed": 1, "mojibake_fixed": 1}


def test_normalize_whitespace_keeps_indentation():
    step = build_map_step(NormalizeStep())
    text = "\n\n  \nTitle  \r\nline\u00a0two\t\r\n\n\n\n\n\ndef f():\n    return  1   \n\n\n"
    out, reason = step.apply(Doc("d", text))
    assert reason is None
    assert out.text == "Title\nline two\n\n\ndef f():\n    return  1"
    assert step.take_counts() == {"whitespace": 1}


def test_normalize_options_off_and_empty():
    raw = "cafÃ© \x00 \r\n"
    assert run(NormalizeStep(fix_mojibake=False, strip_control=False, whitespace=False), raw) == (raw, None)
    assert run(NormalizeStep(fix_mojibake=False), raw) == ("cafÃ©", None)
    assert run(NormalizeStep(), " \n\t\x00\x01 \r\n") == (None, "empty")
    assert run(NormalizeStep(), "") == (None, "empty")


# --------------------------------------------------------------------------- gopher_quality


def test_gopher_defaults_come_from_config():
    cfg = GopherQualityStep()
    assert (cfg.min_words, cfg.max_words, cfg.min_stop_words) == (50, 100_000, 2)
    step = build_map_step(cfg)
    m = step.score(Doc("d", EN))
    assert m["n_words"] == len(EN_WORDS) and m["stop_words"] >= 20 and m["alpha_ratio"] == 1.0
    assert 4 < m["mean_word_length"] < 5
    assert set(m) == {"n_words", "mean_word_length", "symbol_ratio", "bullet_ratio", "ellipsis_ratio",
                      "alpha_ratio", "stop_words"}


def test_gopher_word_count_bounds_at_the_boundary():
    fifty = " ".join(EN_WORDS[:50])
    assert run(GopherQualityStep(), fifty)[1] is None
    assert run(GopherQualityStep(), " ".join(EN_WORDS[:49]))[1] == "gopher:too_few_words"
    assert run(GopherQualityStep(min_words=49), " ".join(EN_WORDS[:49]))[1] is None
    assert run(GopherQualityStep(max_words=50), fifty)[1] is None
    assert run(GopherQualityStep(max_words=49), fifty)[1] == "gopher:too_many_words"


def test_gopher_mean_word_length():
    short = "the of " + " ".join(["ab", "cd", "ef", "gh"] * 15)
    long = "the of " + " ".join(["incomprehensibilities", "uncharacteristically"] * 30)
    assert run(GopherQualityStep(), short)[1] == "gopher:mean_word_length"
    assert run(GopherQualityStep(), long)[1] == "gopher:mean_word_length"
    # Mean of exactly 3.0 is inside [3, 10].
    assert run(GopherQualityStep(), "the and " + " ".join(["abc"] * 60))[1] is None


def test_gopher_symbols_hashes_and_ellipses():
    words = EN_WORDS[:100]
    tagged = " ".join(words[:90]) + " " + " ".join(f"#tag{i}" for i in range(10))  # 10 / 100 words
    assert run(GopherQualityStep(), tagged)[1] is None
    tagged11 = " ".join(words[:89]) + " " + " ".join(f"#tag{i}" for i in range(11))
    assert run(GopherQualityStep(), tagged11)[1] == "gopher:symbol_ratio"
    trailing = " ".join(w + ("…" if i % 5 == 0 else "") for i, w in enumerate(words))  # 20 per 100
    assert run(GopherQualityStep(), trailing)[1] == "gopher:symbol_ratio"
    assert run(GopherQualityStep(max_symbol_word_ratio=0.2), trailing)[1] is None


def test_gopher_bullet_and_ellipsis_lines():
    item = "the quality of the water in the river and the towns along it"
    bullets = "\n".join(f"• {item} {i}" for i in range(10))
    assert run(GopherQualityStep(), bullets)[1] == "gopher:bullet_lines"
    nine_of_ten = "\n".join([f"- {item} {i}" for i in range(9)] + [item])  # 0.9 is not above 0.9
    assert run(GopherQualityStep(), nine_of_ten)[1] is None
    assert run(GopherQualityStep(), "\n".join(f"* {item} {i}" for i in range(10)))[1] == "gopher:bullet_lines"
    # Blank lines do not dilute the ratio; a dash inside a word is not a bullet.
    spaced = "\n\n\n".join(f"• {item} {i}" for i in range(10))
    assert run(GopherQualityStep(), spaced)[1] == "gopher:bullet_lines"
    assert run(GopherQualityStep(), "\n".join(f"-{item} {i}" for i in range(10)))[1] is None

    teaser = "\n".join(f"{item} {i} ..." if i < 4 else f"{item} {i}." for i in range(10))  # 4 of 10
    assert run(GopherQualityStep(), teaser)[1] == "gopher:ellipsis_lines"
    assert run(GopherQualityStep(max_ellipsis_lines_ratio=0.4), teaser)[1] is None


def test_gopher_alpha_words_and_stop_words():
    table = "the of " + " ".join(str(1000 + i) for i in range(40)) + " " + " ".join(EN_WORDS[:60])
    assert run(GopherQualityStep(), table)[1] == "gopher:alpha_words"  # 62 / 102 words have letters
    assert run(GopherQualityStep(min_alpha_words_ratio=0.6), table)[1] is None
    salad = " ".join(random.Random(0).choice(["apple", "river", "green", "stone", "quickly"])
                     for _ in range(80))
    assert run(GopherQualityStep(), salad)[1] == "gopher:stop_words"
    assert run(GopherQualityStep(), salad + " The with")[1] is None  # case-insensitive, 2 needed
    assert run(GopherQualityStep(), DE)[1] == "gopher:stop_words"
    assert run(GopherQualityStep(), FR)[1] == "gopher:stop_words"


# --------------------------------------------------------------------------- c4_quality


def test_c4_lorem_ipsum():
    assert run(C4QualityStep(), EN + "\nLorem  Ipsum dolor sit amet.")[1] == "c4:lorem_ipsum"
    assert run(C4QualityStep(drop_lorem_ipsum=False), EN + "\nLorem ipsum dolor sit amet.")[1] is None


def test_c4_boilerplate_lines_removed_or_page_dropped():
    boiler = ["This site uses cookies to improve your experience.", "Please enable JavaScript to comment.",
              "Read our Privacy Policy.", "By using it you agree to the Terms of Use."]
    page = EN + "\n" + "\n".join(boiler) + "\nBake the cookies for ten minutes."
    text, reason = run(C4QualityStep(), page)
    assert reason is None and text == EN + "\nBake the cookies for ten minutes."
    assert run(C4QualityStep(drop_boilerplate_lines=False), page) == (page, None)

    step = build_map_step(C4QualityStep())
    half = "\n".join(boiler + EN_WORDS[:4])  # 4 of 8 lines: exactly the 0.5 limit
    assert step.score(Doc("d", half))["boilerplate_ratio"] == 0.5
    assert run(C4QualityStep(min_terminal_punct_lines_ratio=0), half)[1] is None
    assert run(C4QualityStep(), "\n".join(boiler + EN_WORDS[:3]))[1] == "c4:boilerplate"
    everything = "\n".join(boiler)
    assert run(C4QualityStep(max_boilerplate_lines_ratio=1, min_terminal_punct_lines_ratio=0),
               everything)[1] == "c4:boilerplate"


def test_c4_terminal_punctuation_ratio():
    menu = "Home\nAbout us\nProducts\nContact\nBlog\nCareers\nLogin\nSign up\nHelp"
    assert run(C4QualityStep(), menu)[1] == "c4:terminal_punct"
    step = build_map_step(C4QualityStep())
    assert step.score(Doc("d", menu)) == {"terminal_punct_ratio": 0.0, "boilerplate_ratio": 0.0}
    quoted = ["He said “stop.”", "She asked «why?»", "It ended!", "Fine.", "A list item"]
    assert step.score(Doc("d", "\n\n".join(quoted)))["terminal_punct_ratio"] == 0.8
    cfg = C4QualityStep(min_terminal_punct_lines_ratio=0.25)
    assert run(cfg, "One.\ntwo\nthree\nfour")[1] is None  # 1 of 4 = 0.25
    assert run(cfg, "One.\ntwo\nthree\nfour\nfive")[1] == "c4:terminal_punct"


def test_c4_code_heavy_text_is_dropped():
    code = "\n".join(f"for (int i = 0; i < n{k}; ++i) {{\n    x[i] = y[i] * {k};\n}}" for k in range(5))
    assert run(C4QualityStep(), code)[1] == "c4:terminal_punct"


# --------------------------------------------------------------------------- repetition


def _reference_dup_ngram_chars(words: list[str], n: int) -> int:
    """The reference full left-to-right scan (datatrove's find_all_duplicate semantics)."""
    seen, chars, i = set(), 0, 0
    while i < len(words) - n + 1:
        gram = " ".join(words[i:i + n])
        if gram in seen:
            chars += len(gram)
            i += n
        else:
            seen.add(gram)
            i += 1
    return chars


def _reference_top_ngram_chars(words: list[str], n: int) -> int:
    grams = [" ".join(words[i:i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0
    top = max(grams.count(g) for g in grams)
    return top * max(len(g) for g in grams if grams.count(g) == top)


def test_ngram_repetition_matches_the_reference_scans():
    rng = random.Random(0)
    ns = [2, 3, 4, 5, 7, 10]
    for trial in range(300):
        vocab = ["a", "bb", "ccc", "dd", "e", "ffff"][: 2 + trial % 5] if trial % 3 else [
            "w" * (1 + i % 7) + str(i) for i in range(40)]
        words = [rng.choice(vocab) for _ in range(rng.randint(0, 60))]
        got = list(ngram_repetition(words, ns))
        assert [n for n, _, _ in got] == ns
        for n, top, dup in got:
            assert dup == _reference_dup_ngram_chars(words, n), (words, n)
            assert top == _reference_top_ngram_chars(words, n), (words, n)
    # "a b a b a b": (a b) new, (b a) new, (a b) repeat -> skip 2, (a b) repeat: 3 + 3 chars.
    assert list(ngram_repetition("a b a b a b".split(), [2])) == [(2, 9, 6)]
    assert list(ngram_repetition("x yy z".split(), [2, 4])) == [(2, 4, 0), (4, 0, 0)]


def test_repetition_defaults_and_clean_text():
    cfg = RepetitionStep()
    assert cfg.max_top_ngram_char_frac == {2: 0.20, 3: 0.18, 4: 0.16}
    m = build_map_step(cfg).score(Doc("d", EN))
    assert set(m) == {"dup_para_frac", "dup_para_char_frac", "dup_line_frac", "dup_line_char_frac",
                      "top_2gram_char_frac", "top_3gram_char_frac", "top_4gram_char_frac",
                      *(f"dup_{n}gram_char_frac" for n in range(5, 11))}
    assert m["dup_line_frac"] == 0 and m["dup_10gram_char_frac"] == 0 and m["top_2gram_char_frac"] < 0.05


def _lines(k: int) -> list[str]:
    return [f"Line {i} talks about the {w} near the old mill." for i, w in enumerate(EN_WORDS[:k])]


def test_repetition_duplicate_lines():
    distinct = _lines(10)
    loose = RepetitionStep(max_dup_line_char_frac=1, max_top_ngram_char_frac={}, max_dup_ngram_char_frac={})
    three = "\n".join(distinct + distinct[:3])  # 3 of 13 lines repeat: 0.23
    four_of_ten = "\n".join(distinct[:6] + distinct[:4])  # 0.4
    assert run(loose, three)[1] is None
    assert run(loose, four_of_ten)[1] == "repetition:dup_lines"
    exactly = "\n".join(distinct[:7] + distinct[:3])  # 3 of 10 = 0.3 is not above 0.3
    assert run(loose, exactly)[1] is None
    # One long line repeated once: few duplicate lines, many duplicate characters.
    long_line = " ".join(EN_WORDS[:60])
    text = "\n".join(distinct + [long_line, long_line])
    assert run(RepetitionStep(max_top_ngram_char_frac={}, max_dup_ngram_char_frac={}), text)[1] == (
        "repetition:dup_line_chars")


def test_repetition_duplicate_paragraphs():
    paras = [" ".join(EN_WORDS[i * 20:(i + 1) * 20]) for i in range(6)]
    assert run(RepetitionStep(), "\n\n".join(paras))[1] is None
    doubled = "\n\n".join(paras + paras[:3])
    assert run(RepetitionStep(), doubled)[1] == "repetition:dup_paras"
    one_long = "\n\n".join(paras[:5] + [" ".join(EN_WORDS[120:200])] * 2)  # 1 of 7, but many chars
    assert run(RepetitionStep(), one_long)[1] == "repetition:dup_para_chars"


def test_repetition_ngrams():
    spam = " ".join(f"buy now {w}" for w in EN_WORDS[:60])  # "buy now" covers ~53% of the chars
    step = build_map_step(RepetitionStep())
    assert 0.5 < step.score(Doc("d", spam))["top_2gram_char_frac"] < 0.6
    assert run(RepetitionStep(), spam)[1] == "repetition:top_2gram"
    assert run(RepetitionStep(max_top_ngram_char_frac={2: 0.6}, max_dup_ngram_char_frac={}), spam)[1] is None
    sentence = " ".join(EN_WORDS[:20])
    repeated = " ".join(EN_WORDS[20:120]) + " " + " ".join([sentence] * 3)  # no line/para repeats
    once = " ".join(EN_WORDS[10:120]) + " " + " ".join([" ".join(EN_WORDS[:10])] * 2)
    assert run(RepetitionStep(), once)[1] is None  # one repeated 10-word phrase is fine
    assert run(RepetitionStep(), repeated)[1] == "repetition:dup_5gram"
    only_10 = RepetitionStep(max_top_ngram_char_frac={}, max_dup_ngram_char_frac={10: 0.1})
    assert run(only_10, repeated)[1] == "repetition:dup_10gram"


# --------------------------------------------------------------------------- harmful


def test_harmful_word_boundaries_case_and_phrases():
    cfg = HarmfulStep(blocklist=["Bad", "evil plan", "f*ck"])
    assert run(cfg, "A badge, badly made, a bad_word and a badminton game.")[1] is None
    assert run(cfg, "This is BAD!")[1] == "harmful:blocklist"
    assert run(cfg, "the Evil \n  Plan works")[1] == "harmful:blocklist"
    assert run(cfg, "the evil planet")[1] is None
    assert run(cfg, "what the f*ck.")[1] == "harmful:blocklist"
    assert run(cfg, "what the f*cking")[1] is None


def test_harmful_limits_and_counts():
    text = "bad apples and a bad day, " + " ".join(EN_WORDS[:94])  # 2 hits in 100 words
    assert run(HarmfulStep(blocklist=["bad"], max_hits=2), text)[1] is None
    assert run(HarmfulStep(blocklist=["bad"], max_hits=1), text)[1] == "harmful:blocklist"
    assert run(HarmfulStep(blocklist=["bad"], max_hits=9, max_hit_ratio=0.02), text)[1] is None
    tight = HarmfulStep(blocklist=["bad"], max_hits=9, max_hit_ratio=0.019)
    assert run(tight, text)[1] == "harmful:blocklist"
    step = build_map_step(HarmfulStep(blocklist=["bad", "bad day"]))
    step.apply(Doc("a", text))
    step.apply(Doc("b", EN))
    assert step.score(Doc("a", text))["blocklist_hits"] == 3
    assert step.take_counts() == {"matches": 3, "docs_with_matches": 1}
    assert step.take_counts() == {}
    with pytest.raises(ValueError, match="block list is empty .* would remove nothing"):
        build_map_step(HarmfulStep(lists=[]))  # an empty step would run, remove nothing and look clean


def test_harmful_ships_a_default_list_and_says_which_ran():
    """The default is a real list (LDNOOBW, English, CC BY 4.0, shipped with its licence), not an empty
    one that removes nothing; describe() names each source and its entries."""
    from lmforge.data.curate.steps.harmful import SHIPPED

    shipped = SHIPPED["ldnoobw-en"]
    entries = [line for line in shipped.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(entries) == 403 and (shipped.parent / "LDNOOBW-LICENSE.txt").read_text().startswith(
        "Attribution 4.0 International")
    step = build_map_step(HarmfulStep())
    assert step.describe()["block_lists"] == {"ldnoobw-en": 403}
    for entry in (entries[0], entries[1], entries[-1]):  # a word, a phrase, an emoji
        assert step.apply(Doc("d", f"{EN} {entry.upper()} and more."))[1] == "harmful:blocklist", entry
    assert step.apply(Doc("d", EN))[1] is None
    mine = build_map_step(HarmfulStep(blocklist=["bad", "Bad ", "worse"]))
    assert mine.describe() == {"summary": "405 block-list entries from ldnoobw-en (403), blocklist (2)",
                               "block_lists": {"ldnoobw-en": 403, "blocklist": 2}, "entries": 405}
    assert build_map_step(HarmfulStep(lists=[], blocklist=["bad"])).describe()["block_lists"] == {
        "blocklist": 1}


def test_harmful_blocklist_files(tmp_path):
    path = tmp_path / "block.txt"
    path.write_text("# a comment\n\nworst\n  Very   Bad Thing \n", encoding="utf-8")
    cfg = HarmfulStep(blocklist_files=[str(path)])
    assert run(cfg, "the very bad thing happened")[1] == "harmful:blocklist"
    assert run(cfg, "a comment on the worst")[1] == "harmful:blocklist"
    assert run(cfg, "a comment on the weather")[1] is None
    with pytest.raises(ValueError, match="blocklist_files.*missing.txt"):
        build_map_step(HarmfulStep(blocklist_files=[str(tmp_path / "missing.txt")]))


def test_harmful_large_list_uses_word_lookup():
    words = [f"w{i}x" for i in range(20_000)]
    step = build_map_step(HarmfulStep(lists=[], blocklist=[*words, "two words"]))
    assert step._phrase_re.pattern.count("|") == 0  # only the phrase is in the regex
    assert step.apply(Doc("d", EN + " w19999x"))[1] == "harmful:blocklist"
    assert step.apply(Doc("d", EN))[1] is None


# --------------------------------------------------------------------------- language

SAMPLES = {
    "es": "La historia del valle es, en muchos sentidos, la historia de las personas que se asentaron a lo "
          "largo de sus orillas. Mucho antes de que se construyeran los primeros caminos, los campesinos y "
          "los comerciantes usaban el agua como su ruta principal hacia la costa.",
    "it": "La storia della valle è, per molti aspetti, la storia delle persone che si sono stabilite lungo "
          "le sue rive. Molto prima che fossero costruite le prime strade, i contadini e i mercanti usavano "
          "l'acqua come la loro via principale verso la costa.",
    "pt": "A história do vale é, em muitos aspectos, a história das pessoas que se estabeleceram ao longo "
          "das suas margens. Muito antes de serem construídas as primeiras estradas, os agricultores e os "
          "comerciantes usavam a água como o seu principal caminho para a costa.",
    "nl": "De geschiedenis van het dal is in veel opzichten de geschiedenis van de mensen die zich langs de "
          "oevers hebben gevestigd. Lang voordat de eerste wegen werden aangelegd, gebruikten boeren en "
          "handelaars het water als hun belangrijkste route naar de kust.",
    "de": DE,
    "fr": FR,
    "en": EN,
}


@pytest.mark.parametrize("lang", sorted(SAMPLES))
def test_language_detects_each_profile(lang):
    text = SAMPLES[lang]
    expected = (text, None) if lang == "en" else (None, f"language:{lang}")
    assert run(LanguageStep(), text) == expected  # default: English only
    out, reason = build_map_step(LanguageStep(languages=[lang])).apply(Doc("d", text))
    assert reason is None and out.meta["language"] == lang


def test_language_short_unknown_and_thresholds():
    assert run(LanguageStep(), "Das ist ein kurzer Satz.") == ("Das ist ein kurzer Satz.", None)
    code = "\n".join(f"x{i} = np.zeros((n, m)) + y[{i}] ** 2 / z" for i in range(10))
    assert run(LanguageStep(), code)[1] == "language:unknown"
    russian = " ".join(["Река течёт через старый город и мельницу"] * 5)
    assert run(LanguageStep(), russian)[1] == "language:unknown"
    step = build_map_step(LanguageStep())
    share = step.score(Doc("d", EN))["language_score"]
    assert 0.9 < share < 1
    assert run(LanguageStep(min_score=share), EN)[1] is None
    assert run(LanguageStep(min_score=1.0), EN)[1] == "language:unknown"
    mixed = EN + "\n\n" + DE + "\n\n" + DE
    assert run(LanguageStep(languages=["en", "de"]), mixed)[1] is None
    with pytest.raises(ValueError, match="languages.*'xx'.*supported"):
        build_map_step(LanguageStep(languages=["en", "xx"]))


# --------------------------------------------------------------------------- length


def test_length_bounds():
    assert run(LengthStep(), "x") == ("x", None)  # defaults drop nothing
    assert run(LengthStep(min_chars=5), "abcde")[1] is None
    assert run(LengthStep(min_chars=6), "abcde")[1] == "length:too_short"
    assert run(LengthStep(max_chars=5), "abcde")[1] is None
    assert run(LengthStep(max_chars=4), "abcde")[1] == "length:too_long"
    assert run(LengthStep(min_lines=3), "a\n\n  \nb\nc")[1] is None
    assert run(LengthStep(min_lines=3), "a\n\n  \nb\n")[1] == "length:too_few_lines"
    assert build_map_step(LengthStep()).score(Doc("d", "a\n\nb")) == {"chars": 4, "lines": 2}


def test_all_reasons_are_short_and_stable():
    reason_re = re.compile(r"^(empty|[a-z0-9]+:[a-z0-9_]+)$")
    reasons = [
        run(GopherQualityStep(), "too short")[1], run(C4QualityStep(), "Home\nAbout")[1],
        run(LanguageStep(), DE)[1], run(LengthStep(min_chars=10), "x")[1], run(NormalizeStep(), " ")[1],
    ]
    assert all(r and reason_re.match(r) for r in reasons), reasons
