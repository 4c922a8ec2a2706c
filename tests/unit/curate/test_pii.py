"""PII redaction: positives per type replaced exactly, look-alikes left alone, counts, type selection."""

from __future__ import annotations

from collections import Counter

import pytest
from pydantic import ValidationError

from lmforge.config.curate import PiiStep
from lmforge.data.curate.doc import Doc
from lmforge.data.curate.steps.pii import Step, iban_ok, luhn_ok, phone_spans, redact

ALL = frozenset(PiiStep().types)

POSITIVES = [
    # e-mail
    ("john.doe@example.com", "<EMAIL>", "email"),
    ("Contact: jane_smith+news@mail.co.uk.", "Contact: <EMAIL>.", "email"),
    ("write to <ops-team@sub.example-corp.io>", "write to <<EMAIL>>", "email"),
    # phone (US numbers in area code 202: 555 is no area code, see NEGATIVES)
    ("+44 20 7946 0958", "<PHONE>", "phone"),
    ("call +1 (202) 555-0143 today", "call <PHONE> today", "phone"),
    ("(202) 555-0143", "<PHONE>", "phone"),
    ("tel: 202-555-0143.", "tel: <PHONE>.", "phone"),
    ("202.555.0143", "<PHONE>", "phone"),
    ("1-800-555-0199", "<PHONE>", "phone"),
    ("Berlin office +49-30-1234567", "Berlin office <PHONE>", "phone"),
    ("+33 1 23 45 67 89", "<PHONE>", "phone"),
    ("+12025550143", "<PHONE>", "phone"),
    ("+1 202 555 0143 ext. 12, then", "<PHONE>, then", "phone"),
    ("(416) 555-0199", "<PHONE>", "phone"),  # Canada, through the US region (+1 plan)
    ("+61 2 9876 5432", "<PHONE>", "phone"),  # any country when written with +
    # national formats of the default phone_regions (US, GB, IN, DE, FR)
    ("London office 020 7946 0958.", "London office <PHONE>.", "phone"),
    ("call 0207 946 0958", "call <PHONE>", "phone"),  # grouped the common wrong way
    ("0044 20 7946 0958", "<PHONE>", "phone"),  # international prefix dialled from the UK
    ("Tel. 030 1234567", "Tel. <PHONE>", "phone"),
    ("Tel.: (030) 12345678", "Tel.: <PHONE>", "phone"),
    ("Tel. 089/12345678", "Tel. <PHONE>", "phone"),
    ("Handy 0171 1234567", "Handy <PHONE>", "phone"),
    ("+49 (0)30 1234567", "<PHONE>", "phone"),
    ("Paris : 01 42 68 53 00", "Paris : <PHONE>", "phone"),
    ("portable 06.12.34.56.78", "portable <PHONE>", "phone"),
    ("mobile 98765 43210", "mobile <PHONE>", "phone"),
    ("+91 98765 43210", "<PHONE>", "phone"),
    ("Delhi 011 2345 6789", "Delhi <PHONE>", "phone"),
    # IPv4 / IPv6: one placeholder, counted per version
    ("ping 8.8.8.8", "ping <IP_ADDRESS>", "ipv4"),
    ("server at 93.184.216.34:8080", "server at <IP_ADDRESS>:8080", "ipv4"),
    ("from 172.217.3.110.", "from <IP_ADDRESS>.", "ipv4"),
    ("2606:4700:4700::1111", "<IP_ADDRESS>", "ipv6"),
    ("[2a00:1450:4001:82b::200e]:443", "[<IP_ADDRESS>]:443", "ipv6"),
    ("2001:4860:4860:0000:0000:0000:0000:8888", "<IP_ADDRESS>", "ipv6"),
    # credit cards (Luhn-valid test numbers of several networks and groupings)
    ("card 4111 1111 1111 1111 exp", "card <CREDIT_CARD> exp", "credit_card"),
    ("4111-1111-1111-1111", "<CREDIT_CARD>", "credit_card"),
    ("4111111111111111", "<CREDIT_CARD>", "credit_card"),
    ("5500 0000 0000 0004", "<CREDIT_CARD>", "credit_card"),
    ("amex 3782 822463 10005", "amex <CREDIT_CARD>", "credit_card"),
    ("6011111111111117", "<CREDIT_CARD>", "credit_card"),
    ("4111 1111 1111 1111 20 items", "<CREDIT_CARD> 20 items", "credit_card"),
    # SSN
    ("SSN 078-05-1120", "SSN <SSN>", "ssn"),
    ("123-45-6789", "<SSN>", "ssn"),
    # IBAN
    ("IBAN DE89 3704 0044 0532 0130 00 please", "IBAN <IBAN> please", "iban"),
    ("GB82WEST12345698765432", "<IBAN>", "iban"),
    ("FR14 2004 1010 0505 0001 3M02 606", "<IBAN>", "iban"),
    ("NL91ABNA0417164300", "<IBAN>", "iban"),
    # secrets
    ("aws AKIAIOSFODNN7EXAMPLE", "aws <SECRET>", "secret"),
    ("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", "<SECRET>", "secret"),
    ("github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz", "<SECRET>", "secret"),
    ("xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx", "<SECRET>", "secret"),
    ("api_key = 'a8F3kL9qZ2xW7vB1nM4tR6yU'", "api_key = '<SECRET>'", "secret"),
    ('"client_secret": "9fJ2kL0pQ8zX3cV7bN1mA5sD"', '"client_secret": "<SECRET>"', "secret"),
    ("GITHUB_TOKEN=Zx81kQp0Lm27Vb4nTr9sWe3d", "GITHUB_TOKEN=<SECRET>", "secret"),
    (
        "key:\n-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA1234567890abcdef\nabcdefABCDEF12==\n"
        "-----END RSA PRIVATE KEY-----\nafter",
        "key:\n<SECRET>\nafter",
        "secret",
    ),
    ("-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEF\n\nThe end.",
     "<SECRET>\n\nThe end.", "secret"),
]

NEGATIVES = [
    # versions and section numbers are not IPv4
    "version 1.2.3.4", "v1.2.3.4", "Python 3.11.4.1", "see section 1.2.3.4 for details", "release 10.0.19.41",
    "1.2.3", "3.14.15.92.65", "OID 1.3.6.1.4.1.311",
    # private, loopback, documentation and special addresses identify no one
    "192.168.1.1", "127.0.0.1", "10.0.0.1", "0.0.0.0", "255.255.255.0", "192.0.2.1", "2001:db8::1", "::1",
    "fe80::1", "256.1.1.1", "01.02.03.04",
    # dates, numbers, prices, times
    "2023-01-15", "15/01/2023", "12.03.2024", "3.14159", "1,234.56", "$1,234,567.89", "1697040000",
    "1697040000123", "2023-01-15T10:30:00Z", "10:30:45", "ratio 1:2:3", "phone 5551234567",
    "call 555-1234 now", "tracking 12345678901234567890", "UTC offset +000000120",
    # ISBNs, hashes, UUIDs
    "ISBN 978-3-16-148410-0", "ISBN 9780306406157", "ISBN 0-306-40615-2",
    "commit 3f786850e387550fdab836ed7e6dc881de23001b", "123e4567-e89b-12d3-a456-426614174000",
    "12345678-1234-1234-1234-123456789012",
    "sha256 e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    # code with ::
    "std::vector<int> v;", "a[1::2]", "Foo::Bar::baz()", "x = y[::-1]", "MAC 00:1A:2B:3C:4D:5E",
    "dead::beef", "using ::testing::Return;",
    # SSN and card look-alikes
    "123-45-678", "000-12-3456", "666-12-3456", "900-12-3456", "123-00-4567", "123-45-0000",
    "4111 1111 1111 1112", "1234567890123456", "0000 0000 0000 0000", "3704 0044 0532 0130 01",
    # IBAN look-alikes: wrong check digits, unknown country
    "DE89 3704 0044 0532 0130 01", "XX89370400440532013000",
    # phone look-alikes: area code 555 was never assigned, a fictional number identifies no one (as
    # 192.0.2.1); 07700 900xxx is Ofcom's drama range; bare digit runs are ids and timestamps
    "(555) 123-4567", "call +1 (555) 123-4567", "555-123-4567", "555.123.4567", "+44 7700 900123",
    "2025550143", "9876543210", "'{:,}'.format(1234567890)",
    "2024-01-15", "3.14159265", "0.123456789", "3.141592653589793", "15.01.2024", "01/15/2024",
    "2024-01-15 10:30:45", "1 234 567 890", "10 000 000", "1,234,567,890", "pp. 123-4567",
    "1990-2000 and 2001-2010", "id 1234-5678-9012", "ISSN 0317-8471", "0-306-40615-2",
    "978-0-306-40615-7", "ISBN 0-306-40615-3", "Steuernummer 21/815/08150", "255.255.255.0", "+0 123 456 789",
    "numbers 01 02 03 04 05 06 07", "4006381333931",
    # e-mail look-alikes
    "user@localhost", "icon@2x.png", "@property", "name @ example",
    # secret look-alikes
    'api_key = os.environ["API_KEY"]', "token = 'YOUR_API_KEY_HERE'", "password = 'hunter2'",
    "tokenizer = AutoTokenizer.from_pretrained(name)", "secret_sauce = 1234567890123456",
    "-----BEGIN PUBLIC KEY-----", "AKIA is a prefix",
]


@pytest.mark.parametrize("text,expected,kind", POSITIVES)
def test_positive(text, expected, kind):
    step = Step(PiiStep())
    out, reason = step.apply(Doc("d", text))
    assert reason is None and out.text == expected
    assert step.take_counts() == {kind: 1}
    assert step.take_counts() == {}  # counts reset


@pytest.mark.parametrize("text", NEGATIVES)
def test_negative_unchanged(text):
    step = Step(PiiStep())
    doc = Doc("d", text)
    out, reason = step.apply(doc)
    assert out.text == text and reason is None
    assert step.take_counts() == {}


def test_mixed_document_and_counts():
    text = (
        "Mail bob@corp.example.org or call (202) 555-0143 / +44 20 7946 0958. Server 8.8.4.4 and "
        "2606:4700:4700::1111 (v1.2.3.4, released 2023-01-15, costs $1,234.56). Card 4111 1111 1111 1111, "
        "SSN 123-45-6789, IBAN GB82WEST12345698765432, key AKIAIOSFODNN7EXAMPLE."
    )
    step = Step(PiiStep())
    out, _ = step.apply(Doc("d", text, {"k": 1}))
    assert out.text == (
        "Mail <EMAIL> or call <PHONE> / <PHONE>. Server <IP_ADDRESS> and "
        "<IP_ADDRESS> (v1.2.3.4, released 2023-01-15, costs $1,234.56). Card <CREDIT_CARD>, "
        "SSN <SSN>, IBAN <IBAN>, key <SECRET>."
    )
    assert out.meta == {"k": 1} and out.id == "d"
    assert step.take_counts() == {
        "email": 1, "phone": 2, "ipv4": 1, "ipv6": 1, "credit_card": 1, "ssn": 1, "iban": 1, "secret": 1
    }


def test_only_configured_types():
    text = "a@b.example.com 8.8.8.8 123-45-6789"
    step = Step(PiiStep(types=["ssn"]))
    out, _ = step.apply(Doc("d", text))
    assert out.text == "a@b.example.com 8.8.8.8 <SSN>"
    assert step.take_counts() == {"ssn": 1}
    assert redact(text, frozenset({"email", "ipv4"})) == "<EMAIL> <IP_ADDRESS> 123-45-6789"


def test_unchanged_doc_is_same_object():
    doc = Doc("d", "nothing personal here, version 1.2.3.4")
    out, reason = Step(PiiStep()).apply(doc)
    assert out is doc and reason is None


def test_checksums():
    assert luhn_ok("4111111111111111") and not luhn_ok("4111111111111112")
    assert luhn_ok("378282246310005")
    assert iban_ok("DE89370400440532013000") and not iban_ok("DE89370400440532013001")
    assert not iban_ok("DE8937040044053201300")  # wrong length for DE
    assert ALL == {"email", "phone", "ipv4", "ipv6", "credit_card", "ssn", "iban", "secret"}


@pytest.mark.parametrize(
    "text,where",
    [("020 7946 0958", "GB"), ("030 1234567", "DE"), ("01 42 68 53 00", "FR"), ("98765 43210", "IN")],
)
def test_national_formats_only_for_configured_regions(text, where):
    others = [r for r in ("US", "GB", "DE", "FR", "IN") if r != where]
    assert redact(f"call {text} now", {"phone"}, phone_regions=[where]) == "call <PHONE> now"
    # read in a region whose plan it does not fit, it stays
    stepped = Step(PiiStep(phone_regions=["US"])).apply(Doc("d", f"call {text} now"))[0]
    assert stepped.text == f"call {text} now"
    # with "+" and the country code, every region (and none) finds it
    cc = {"GB": "+44", "DE": "+49", "FR": "+33", "IN": "+91"}[where]
    intl = f"call {cc} {text.lstrip('0')} now"
    for regions in (others, ["US"], []):
        assert redact(intl, {"phone"}, phone_regions=regions) == "call <PHONE> now", (intl, regions)


def test_phone_matches_of_several_regions_merge_into_one():
    counts = Counter()
    # every region finds the +44 number, GB and IN both read 020 7946 0958 nationally
    text = "a +44 20 7946 0958 b 020 7946 0958 c"
    assert redact(text, {"phone"}, counts, ["US", "GB", "IN", "DE", "FR"]) == "a <PHONE> b <PHONE> c"
    assert counts == {"phone": 2}
    assert phone_spans(text, ["GB", "IN"]) == [(2, 18), (21, 34)]


def test_ssn_shape_is_no_phone_when_ssn_is_off():
    assert redact("SSN 078-05-1120, tel 030 1234567", {"phone"}) == "SSN 078-05-1120, tel <PHONE>"


def test_phone_in_long_text_is_found_past_the_prefilter():
    filler = "Plain prose with numbers like 3.14, 2024-01-15 and version 1.2.3. " * 2000
    text = filler + "Ring 020 7946 0958 or +49 30 1234567." + filler
    out = redact(text, {"phone"})
    assert out == filler + "Ring <PHONE> or <PHONE>." + filler


def test_phone_regions_validated():
    assert PiiStep().phone_regions == ["US", "GB", "IN", "DE", "FR"]
    assert PiiStep(phone_regions=["gb", "US", "GB"]).phone_regions == ["GB", "US"]
    assert PiiStep(phone_regions=[]).phone_regions == []
    with pytest.raises(ValidationError, match=r"unknown phone region\(s\) 'UK' \(the United Kingdom is GB\)"
                       r".*ISO 3166-1 alpha-2 codes such as US, GB"):
        PiiStep(phone_regions=["UK"])
    with pytest.raises(ValidationError, match="'XX', 'EU'"):
        PiiStep(phone_regions=["US", "XX", "EU"])
