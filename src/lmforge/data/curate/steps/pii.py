"""PII redaction: replace personal data and secrets by typed placeholders; documents are never dropped.

Placeholders, by config type:

    email        <EMAIL>        user.name+tag@example.co.uk
    phone        <PHONE>        +44 20 7946 0958, (202) 555-0143, 020 7946 0958: libphonenumber-valid
                                numbers, national formats only of the configured `phone_regions`
    ipv4, ipv6   <IP_ADDRESS>   one placeholder for both versions (counted separately)
    credit_card  <CREDIT_CARD>  13-19 digits, Luhn-checked, known IIN prefix, card-like grouping
    ssn          <SSN>          AAA-GG-SSSS outside the never-issued ranges
    iban         <IBAN>         known country, that country's length, mod-97 check
    secret       <SECRET>       AWS / GitHub / Slack / Google / Stripe tokens, PEM private keys,
                                and high-entropy values assigned to api_key / secret / token / password

Every pattern is anchored so that it cannot start or end inside a longer word or number, and each
match is validated (checksums, value ranges, context) before it is replaced, because false positives
damage good text: version numbers, dates, prices, timestamps, ISBNs, hashes, UUIDs and C++/Python
`::` must survive. Only *globally routable* IP addresses are redacted (as datatrove does): private,
loopback, link-local and documentation ranges (10.x, 127.0.0.1, 192.168.x, 2001:db8::, ::1) identify
no one, and tutorials are full of them. Likewise only numbers valid in a numbering plan are phones:
the fictional (555) 123-4567 (area code 555 was never assigned) is left alone.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence

import phonenumbers

from lmforge.config.curate import DEFAULT_PHONE_REGIONS
from lmforge.data.curate.doc import Doc
from lmforge.data.curate.step import MapStep

PLACEHOLDERS = {
    "email": "<EMAIL>",
    "phone": "<PHONE>",
    "ipv4": "<IP_ADDRESS>",
    "ipv6": "<IP_ADDRESS>",
    "credit_card": "<CREDIT_CARD>",
    "ssn": "<SSN>",
    "iban": "<IBAN>",
    "secret": "<SECRET>",
}

# --- e-mail ----------------------------------------------------------------------------------------

_EMAIL_RE = re.compile(
    r"(?<![\w.%+-])[A-Za-z0-9](?:[A-Za-z0-9._%+-]{0,62}[A-Za-z0-9_%+-])?"
    r"@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+([A-Za-z]{2,24})(?![\w-]|\.[A-Za-z0-9])"
)
# "icon@2x.png" is a file name, not an address
_FILE_TLDS = frozenset("png jpg jpeg gif svg webp bmp ico tif tiff pdf js css html py txt md".split())


def _email_ok(m: re.Match) -> bool:
    return m.group(1).lower() not in _FILE_TLDS


# --- IP addresses ------------------------------------------------------------------------------------

_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
# (regexes start with a plain `\d` and check the character before it with a lookbehind *after* it:
# a leading lookbehind would stop `re` from skipping ahead to candidate characters, 3x slower)
_IPV4_RE = re.compile(rf"\d(?<![\w.]\d)\d{{0,2}}\.(?:{_OCTET}\.){{2}}{_OCTET}(?![\w]|\.\d)")
# a dotted quad right after one of these words is a version / section number, not an address
_VERSION_CONTEXT_RE = re.compile(
    r"(?i)(?:\bv|\bversions?|\bver|\brelease[sd]?|\brel|\bbuild|\bpython|\bjava|\bnode|\bfirmware|"
    r"\bkernel|\bupdate|\bpatch|\bsection|\bchapter|\bstep|\bfigure|\bfig|\btable|\brule|\bclause|"
    r"\bitem|\bpage|\bno|\bnumber|§)\.?\s*[:=#]?\s*$"
)
_IPV6_RE = re.compile(
    r"(?<![\w:.])(?=[0-9A-Fa-f]*:[0-9A-Fa-f]*:)[0-9A-Fa-f:]{2,39}"
    r"(?:(?<=:)(?:\d{1,3}\.){3}\d{1,3})?(?![\w:]|\.\d)"
)
_IPV6_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")


def _ipv4_ok(m: re.Match) -> bool:
    if _VERSION_CONTEXT_RE.search(m.string, max(0, m.start() - 16), m.start()):
        return False
    try:
        return ipaddress.IPv4Address(m.group()).is_global
    except ValueError:  # first octet > 255 or with a leading zero
        return False


def _ipv6_ok(m: re.Match) -> bool:
    try:
        addr = ipaddress.IPv6Address(m.group())
    except ValueError:  # times (12:30:45), MAC addresses, C++ scopes
        return False
    # only real internet addresses: "a::b" (Python slicing) or "::1" must survive
    return addr in _IPV6_GLOBAL_UNICAST and addr.is_global


# --- phone numbers ---------------------------------------------------------------------------------

# VALID, not POSSIBLE: the number must fit its region's numbering plan (area codes, lengths), which
# keeps most digit look-alikes and the fictional 555 area code out; not STRICT_GROUPING: people group
# digits their own way ("0207 946 0958" for 020 7946 0958) and a missed phone is a leak.
_PHONE_LENIENCY = phonenumbers.Leniency.VALID
# the separators libphonenumber accepts between digit blocks (phonenumberutil._VALID_PUNCTUATION)
_PHONE_SEPS = (
    "\\-x\u2010-\u2015\u2212\u30fc\uff0d-\uff0f \u00a0\u00ad\u200b\u2060\u3000()\uff08\uff09"
    "\uff3b\uff3d.\\[\\]/~\u2053\u223c\uff5e"
)
# PhoneNumberMatcher is pure Python and slow, so it only reads the text around runs of >= 7 digits
# joined by those separators (at most 4 in a row, its own limit). Shorter valid numbers exist (a few
# old lines in small German, Austrian or Italian towns, tiny island plans) but are rare and look like
# any other short number: an accepted miss.
_PHONE_RUN_RE = re.compile(f"\\d(?:[{_PHONE_SEPS}]{{0,4}}\\d){{6,}}")
_PHONE_MARGIN = 32  # room for a leading "+" or "(0)" and a trailing extension around a run
# shapes that some region's plan accepts but that are, in text, something else (a comma is no phone
# separator: 1,234,567 and 3,14 never get here)
_PHONE_SHAPE_REJECT_RE = re.compile(
    r"[1-9]\d?([ \u00a0.])\d{3}(?:\1\d{3})+"  # 1 234 567 890, 12.345.678; but 612 345 678 is Spanish
    r"|\d{1,3}(?:\.\d{1,3}){3}"  # dotted quad: an address or version number the IP types left
    r"|\d{3}-\d{2}-\d{4}"  # SSN shape: the ssn type's call, not a German number
    r"|\d+\.\d+"  # a decimal
    r"|[^/]*/[^/]*/.*"  # two slashes: a date, a path, a file or tax number
)
# 2024-01-15, 15.01.2024, 01/15/2024: common, and never worth the matcher's time
_DATE_RE = re.compile(r"\d{4}([\-./])\d\d?\1\d\d?|\d\d?([\-./])\d\d?\2\d{4}")
_ISBN_SHAPE_RE = re.compile(r"\d+(?:-\d+){2,3}-\d")  # the check digit is a group of its own
_ID_CONTEXT_RE = re.compile(r"(?i)\b(?:isbn(?:-?1[03])?|issn|doi|arxiv|pmid|oid)\s*[:#]?\s*$")


def _isbn(raw: str) -> bool:
    """A hyphenated ISBN-10 or ISBN-13 with a valid check digit."""
    if not _ISBN_SHAPE_RE.fullmatch(raw):
        return False
    d = [int(c) for c in raw if c != "-"]
    if len(d) == 10:
        return sum((10 - i) * c for i, c in enumerate(d)) % 11 == 0
    return len(d) == 13 and sum(c * (3 if i % 2 else 1) for i, c in enumerate(d)) % 10 == 0


def _phone_ok(text: str, start: int, end: int) -> bool:
    raw = text[start:end]
    if not _PHONE_RUN_RE.search(raw):  # a fragment at a window's edge, or too short to be sure
        return False
    if raw[0] != "+":
        # bare digits are ids, timestamps and order numbers far more often than phones; the matcher
        # takes the "(" of f(1234567890) with them
        if raw.strip("()[]").isdigit() or _PHONE_SHAPE_REJECT_RE.fullmatch(raw) or _isbn(raw):
            return False
    return not _ID_CONTEXT_RE.search(text, max(0, start - 16), start)


def _not_phone_run(text: str, start: int, end: int) -> bool:
    """A digit run that is, as a whole, bare digits, a date or another shape _phone_ok rejects."""
    if start and text[start - 1] in "+(":
        return False
    run = text[start:end]
    return run.isdigit() or bool(_DATE_RE.fullmatch(run) or _PHONE_SHAPE_REJECT_RE.fullmatch(run))


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for s, e in sorted(spans):
        if merged and s < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def phone_spans(text: str, regions: Sequence[str]) -> list[tuple[int, int]]:
    """Sorted, non-overlapping (start, end) of the valid phone numbers in `text`.

    Numbers written with "+" and a country code are found whatever the regions; national formats
    only for `regions` (none: international format only).
    """
    runs = [m.span() for m in _PHONE_RUN_RE.finditer(text)]
    found = []
    for i, (s, e) in enumerate(runs):
        if _not_phone_run(text, s, e):
            continue
        # one run per window, never part of a neighbour (whose tail could pass for a number), and a
        # short window: the matcher's time grows with every digit group it is shown
        ws = max(runs[i - 1][1] if i else 0, s - _PHONE_MARGIN)
        we = min(runs[i + 1][0] if i + 1 < len(runs) else len(text), e + _PHONE_MARGIN)
        chunk = text[ws:we]
        # after "+" the country code is written: any region reads it the same, so read it once
        for region in (None,) if text[s - 1 : s] == "+" else regions or (None,):
            for m in phonenumbers.PhoneNumberMatcher(chunk, region, leniency=_PHONE_LENIENCY):
                if _phone_ok(text, ws + m.start, ws + m.end):
                    found.append((ws + m.start, ws + m.end))
    # regions read "+44 20 7946 0958" alike, or one region a longer stretch than another: one phone
    return _merge(found)


def _redact_phones(text: str, regions: Sequence[str], counts: Counter) -> str:
    spans = phone_spans(text, regions)
    if not spans:
        return text
    counts["phone"] += len(spans)
    parts, pos = [], 0
    for s, e in spans:
        parts += [text[pos:s], PLACEHOLDERS["phone"]]
        pos = e
    parts.append(text[pos:])
    return "".join(parts)


# --- credit cards ------------------------------------------------------------------------------------

_CARD_RE = re.compile(r"\d(?<![\w\-.,]\d)(?:[ \-]?\d){12,18}(?![\w\-]|[.,]\d)")
_CARD_GROUPINGS = {(4, 6, 5), (4, 6, 4)}  # Amex, Diners; otherwise groups of 4 (last may be shorter)


def luhn_ok(digits: str) -> bool:
    """The Luhn (mod 10) check of a card number given as a string of digits."""
    total = 0
    for i, c in enumerate(reversed(digits)):
        d = ord(c) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _iin_ok(d: str) -> bool:
    """Issuer prefix and length of Visa, Mastercard, Amex, Discover, JCB, Diners, UnionPay, Maestro."""
    n, p2, p3, p4 = len(d), int(d[:2]), int(d[:3]), int(d[:4])
    if d[0] == "4":
        return n in (13, 16, 19)
    if 51 <= p2 <= 55 or 2221 <= p4 <= 2720:  # Mastercard
        return n == 16
    if p2 in (34, 37):  # Amex
        return n == 15
    if p2 in (36, 38, 39) or 300 <= p3 <= 305:  # Diners
        return n >= 14
    # JCB, Discover, UnionPay
    if 3528 <= p4 <= 3589 or p4 == 6011 or p2 == 65 or 644 <= p3 <= 649 or p2 == 62:
        return n >= 16
    return p2 in (50, 56, 57, 58, 63, 67)  # Maestro: 12-19 digits


def _card_number(text: str) -> bool:
    groups = re.split(r"[ \-]", text)
    seps = set(re.findall(r"[ \-]", text))
    if len(seps) > 1:
        return False
    lens = tuple(map(len, groups))
    if len(groups) > 1 and lens not in _CARD_GROUPINGS and not (
        all(n == 4 for n in lens[:-1]) and 1 <= lens[-1] <= 4
    ):
        return False
    digits = "".join(groups)
    return 13 <= len(digits) <= 19 and _iin_ok(digits) and luhn_ok(digits)


def _card_span(m: re.Match) -> int:
    """Length of the longest prefix of the match (cut at a separator) that is a card number; 0 if none."""
    text = m.group()
    cuts = [len(text)] + [i for i in range(len(text) - 1, 0, -1) if text[i] in " -"]
    for cut in cuts:
        if _card_number(text[:cut]):
            return cut
    return 0


# --- SSN and IBAN ------------------------------------------------------------------------------------

_SSN_RE = re.compile(r"\d(?<![\w\-.]\d)\d\d-\d\d-\d{4}(?![\w\-]|\.\d)")


def _ssn_ok(m: re.Match) -> bool:
    """Never-issued SSNs: area 000, 666 or 9xx; group 00; serial 0000."""
    area, group, serial = m.group().split("-")
    return area not in ("000", "666") and area[0] != "9" and group != "00" and serial != "0000"

_IBAN_LENGTHS = {
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22, "BH": 22, "BR": 29,
    "BY": 28, "CH": 21, "CR": 22, "CY": 28, "CZ": 24, "DE": 22, "DK": 18, "DO": 28, "EE": 20, "EG": 29,
    "ES": 24, "FI": 18, "FO": 18, "FR": 27, "GB": 22, "GE": 22, "GI": 23, "GL": 18, "GR": 27, "GT": 28,
    "HR": 21, "HU": 28, "IE": 22, "IL": 23, "IQ": 23, "IS": 26, "IT": 27, "JO": 30, "KW": 30, "KZ": 20,
    "LB": 28, "LC": 32, "LI": 21, "LT": 20, "LU": 20, "LV": 21, "MC": 27, "MD": 24, "ME": 22, "MK": 19,
    "MR": 27, "MT": 31, "MU": 30, "NL": 18, "NO": 15, "PK": 24, "PL": 28, "PS": 29, "PT": 25, "QA": 29,
    "RO": 24, "RS": 22, "SA": 24, "SC": 31, "SE": 24, "SI": 19, "SK": 24, "SM": 27, "ST": 25, "SV": 28,
    "TL": 23, "TN": 24, "TR": 26, "UA": 29, "VA": 22, "VG": 24, "XK": 20,
}
_IBAN_RE = re.compile(r"(?<![\w\-])([A-Z]{2})(\d{2})((?:[ ]?[A-Z0-9]){11,30})")


def iban_ok(iban: str) -> bool:
    """Country length and ISO 13616 mod-97 check of an IBAN written without spaces."""
    if _IBAN_LENGTHS.get(iban[:2]) != len(iban) or not iban.isalnum():
        return False
    moved = iban[4:] + iban[:4]
    return int("".join(str(int(c, 36)) for c in moved)) % 97 == 1


def _iban_span(m: re.Match) -> int:
    """Length of the match's prefix that is exactly one valid IBAN (its country's length); 0 if none."""
    text = m.group()
    need = _IBAN_LENGTHS.get(m.group(1))
    if need is None:
        return 0
    count = 0
    for i, c in enumerate(text):
        if c != " ":
            count += 1
        if count == need:
            end = i + 1
            if end < len(text) and text[end] != " ":  # the IBAN must end at a group boundary
                return 0
            return end if iban_ok(text[:end].replace(" ", "")) else 0
    return 0


# --- secrets --------------------------------------------------------------------------------------

_PEM_RE = re.compile(
    r"-----BEGIN (?P<kind>(?:[A-Z0-9]+ )*)PRIVATE KEY( BLOCK)?-----"
    # up to the matching END line; without one, the header lines and whole-line base64 that follow
    r"(?:[\s\S]{0,20000}?-----END (?P=kind)PRIVATE KEY( BLOCK)?-----"
    r"|(?:[ \t]*\r?\n[ \t]*(?:[A-Za-z0-9+/=]+|[A-Za-z\-]+:[^\n]*)(?=[ \t]*(?:\r?\n|$)))*)"
)
_TOKEN_RE = re.compile(
    r"(?<![\w\-])(?:"
    r"(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}"  # AWS access key id
    r"|gh[pousr]_[A-Za-z0-9]{36,255}"  # GitHub classic tokens
    r"|github_pat_[A-Za-z0-9_]{22,255}"  # GitHub fine-grained tokens
    r"|xox[baprs]-[A-Za-z0-9\-]{10,250}"  # Slack
    r"|AIza[0-9A-Za-z_\-]{35}"  # Google API key
    r"|(?:sk|rk)_live_[0-9A-Za-z]{16,250}"  # Stripe secret / restricted keys
    r")(?![\w\-])"
)
# api_key = "..." / "client_secret": "..." / token: ... / password => ...; only the value is replaced
_ASSIGN_RE = re.compile(
    r"(?i)(?P<name>(?:api[_\-]?key|apikey|secret|token|passw(?:or)?d|passwd|private[_\-]?key|"
    r"access[_\-]?key)[\w\-]*)(?P<op>[\"']?\s*(?::=|=>|[:=])\s*)(?P<q>[\"'`]?)"
    r"(?P<value>[A-Za-z0-9+/_\-.=~!@#$%^&*]{16,512})(?P=q)"
)


def shannon_entropy(s: str) -> float:
    """Bits per character of `s`'s character distribution."""
    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in Counter(s).values())


def _secret_value_ok(value: str) -> bool:
    """High-entropy, mixed letters and digits: a key, not `os.environ[...]` or `YOUR_API_KEY_HERE`."""
    has_digit = any(c.isdigit() for c in value)
    has_alpha = any(c.isalpha() for c in value)
    return has_digit and has_alpha and shannon_entropy(value) >= 3.5


# --- the step -------------------------------------------------------------------------------------

_Validator = Callable[[re.Match], "bool | int"]


def _has_digit(text: str) -> bool:
    return any(c in text for c in "0123456789")


class _Detector:
    """One regex plus a validator: True/False, or the length of the match's prefix to replace."""

    def __init__(
        self,
        kind: str,
        regex: re.Pattern,
        ok: _Validator | None = None,
        needs: Callable[[str], bool] | None = None,
    ) -> None:
        self.kind, self.regex, self.ok = kind, regex, ok
        # a cheap pre-check: skip the regex when the text cannot contain a match
        self.needs = needs or _has_digit

    def redact(self, text: str, counts: Counter) -> str:
        placeholder = PLACEHOLDERS[self.kind]

        def sub(m: re.Match) -> str:
            verdict = True if self.ok is None else self.ok(m)
            if verdict is False or verdict == 0:
                return m.group()
            counts[self.kind] += 1
            if verdict is True:
                return placeholder
            return placeholder + m.group()[verdict:]

        return self.regex.sub(sub, text)


class _AssignedSecret(_Detector):
    def redact(self, text: str, counts: Counter) -> str:
        def sub(m: re.Match) -> str:
            if not _secret_value_ok(m.group("value")):
                return m.group()
            counts["secret"] += 1
            return m.group("name") + m.group("op") + m.group("q") + "<SECRET>" + m.group("q")

        return self.regex.sub(sub, text)


# Order matters: secrets and e-mails first (their digits must not become phones or cards), IBANs
# and cards before SSNs and phones, IPv6 before IPv4 (embedded dotted quads).
_DETECTORS = [
    _Detector("secret", _PEM_RE, needs=lambda t: "-----BEGIN" in t),
    _Detector("secret", _TOKEN_RE, needs=lambda t: True),
    _AssignedSecret("secret", _ASSIGN_RE),  # values need a digit
    _Detector("email", _EMAIL_RE, _email_ok, needs=lambda t: "@" in t),
    _Detector("iban", _IBAN_RE, _iban_span),
    _Detector("credit_card", _CARD_RE, _card_span),
    _Detector("ssn", _SSN_RE, _ssn_ok),
    _Detector("ipv6", _IPV6_RE, _ipv6_ok, needs=lambda t: "::" in t or t.count(":") >= 7),
    _Detector("ipv4", _IPV4_RE, _ipv4_ok),
    # phones last (_redact_phones): every other type's digits are placeholders by then
]


def redact(
    text: str,
    types: set[str] | frozenset[str],
    counts: Counter | None = None,
    phone_regions: Sequence[str] = DEFAULT_PHONE_REGIONS,
) -> str:
    """`text` with the PII of the given types replaced by placeholders; matches added to `counts`.

    `phone_regions`: ISO 3166-1 alpha-2 codes whose national phone formats are recognised.
    """
    counts = Counter() if counts is None else counts
    for det in _DETECTORS:
        if det.kind in types and det.needs(text):
            text = det.redact(text, counts)
    if "phone" in types:
        text = _redact_phones(text, phone_regions, counts)
    return text


class Step(MapStep):
    """Redact the configured PII types (`curate.steps[].types`); counts matches per type."""

    name = "pii"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.types = frozenset(cfg.types)
        self.phone_regions = tuple(cfg.phone_regions)
        self._counts: Counter = Counter()

    def apply(self, doc: Doc) -> tuple[Doc | None, str | None]:
        text = redact(doc.text, self.types, self._counts, self.phone_regions)
        if text == doc.text:
            return doc, None
        return Doc(doc.id, text, doc.meta), None

    def take_counts(self) -> dict[str, int]:
        counts, self._counts = dict(self._counts), Counter()
        return counts
