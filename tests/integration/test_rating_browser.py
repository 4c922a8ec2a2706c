"""The rating page in headless Chromium (Playwright driving Debian's `chromium`, as the dashboard's test
does): two raters rate a small study with the keyboard only, one reloads half-way and resumes where they
were, a hostile answer is shown as text, and the results endpoint gives the win rate and kappa their
choices imply. The server is the job server's app in a thread (no runner: a study needs no jobs), so the
test costs a few seconds.

scripts/test.sh installs Chromium where it can; where it cannot, the test is skipped and says what to
install (.ci/run fails on that skip: CI must run it)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

CHROMIUM = "/usr/bin/chromium"
HOSTILE = '<script>document.title="pwned"</script><img id=injected src=x onerror="document.title=1">'
PROMPTS = ["Name a colour.", "Say hello.", "Count to three.", "Pick a fruit."]
X = ["blue", "hello there", "1 2 3", "apple"]
Y = ["bleu", HOSTILE, "one two", "pear"]


def _playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the rating browser test needs Playwright for Python: pip install playwright (it is in "
                    "lmforge's test extras: pip install -e '.[test]')", pytrace=False)
    exe = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    if exe is None:
        pytest.skip("the rating browser test needs Debian's Chromium at /usr/bin/chromium: apt-get install "
                    "-y chromium (scripts/test.sh does this where it can)")
    return sync_playwright, exe


@pytest.fixture
def served(tmp_path):
    """The job server's app on a free local port, served by uvicorn in a thread."""
    from lmforge.jobserver.app import create_app
    from lmforge.jobserver.auth import create_token
    from lmforge.jobserver.server import free_port

    app = create_app(tmp_path / "ws", start_runner=False)
    tokens = {u: create_token(app.state.store, u) for u in ("owner", "ann", "bob")}
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield url, tokens
    server.should_exit = True
    thread.join(10)


def _until(page, js: str, arg=None, timeout_s: float = 10.0):
    """Poll `js` (a function of `arg`) in the page until it is truthy (the page's CSP forbids the string
    evaluation Playwright's wait_for_function would use)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = page.evaluate(js, arg)
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {js} ({arg})"
        time.sleep(0.05)


def _at(page, index: int, rated: int) -> None:
    """Wait until item `index` is shown, ready, with `rated` items rated."""
    _until(page, "([i, n]) => { const r = document.getElementById('rater');"
           " return r.dataset.state === 'ready' && r.dataset.index === String(i)"
           " && document.getElementById('progress').dataset.rated === String(n); }", [index, rated])


def _key_for(page, index: int, winner: str, keys: dict[str, str]) -> str:
    """The key that picks `winner` ("x" / "y" / "tie") on the item shown, whichever letter X has here."""
    if winner == "tie":
        return keys["tie"]
    x_is_a = page.text_content("#answer-a") == X[index]
    return keys["A"] if (winner == "x") == x_is_a else keys["B"]


def test_two_raters_rate_with_the_keyboard_and_resume_after_a_reload(served):
    sync_playwright, exe = _playwright()
    url, tok = served
    r = httpx.post(url + "/v1/studies", headers={"Authorization": f"Bearer {tok['owner']}"}, json={
        "name": "colours and fruit", "raters": ["ann", "bob"], "prompts": PROMPTS, "seed": 3,
        "x": {"label": "run-alpha", "answers": X}, "y": {"label": "run-beta", "answers": Y}})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    want = {"ann": ["x", "y", "x", "tie"], "bob": ["x", "y", "y", "tie"]}
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, headless=True)
        for rater, keys in (("ann", {"A": "1", "B": "2", "tie": "3"}),
                            ("bob", {"A": "a", "B": "b", "tie": "t"})):
            page = browser.new_context().new_page()  # its own sessionStorage: its own token
            page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
            page.on("response", lambda r: problems.append(f"{r.status} {r.url}") if r.status >= 400 else None)
            page.on("console",
                    lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None)
            page.goto(url + "/rate")
            assert page.title() == "lmforge rating"
            page.fill("#token", tok[rater])
            page.click("#token-use")
            page.click(f"#studies-table tr[data-id='{sid}'] button[data-action='rate']")
            _at(page, 0, 0)
            assert page.text_content("#study-name") == "colours and fruit"
            for i in range(2):
                page.keyboard.press(_key_for(page, i, want[rater][i], keys))
                _at(page, i + 1, i + 1)  # saved, and on to the next item
            shown = page.text_content("#answer-a") + page.text_content("#answer-b")
            assert HOSTILE not in shown  # item 2 now
            body = page.text_content("body")
            assert "alpha" not in body and "beta" not in body  # blind: no run names on the page
            # A reload (same tab: the token stays) resumes at the first unrated item.
            page.reload()
            _at(page, 2, 2)
            # Back with the arrow: the hostile answer of item 1 is text, and the saved choice is marked.
            page.keyboard.press("ArrowLeft")
            _at(page, 1, 2)
            side = "#answer-a" if page.text_content("#answer-a") != X[1] else "#answer-b"
            assert page.text_content(side) == HOSTILE
            assert page.locator("#injected").count() == 0 and page.title() == "lmforge rating"
            chosen = page.locator("#rater button.chosen").get_attribute("data-choice")
            assert chosen == ("B" if side == "#answer-b" else "A")  # this rater chose Y on item 1
            page.keyboard.press("ArrowRight")
            _at(page, 2, 2)
            # A comment, then the keys again (Escape leaves the comment box).
            page.fill("#comment", "close call")
            page.keyboard.press("Escape")
            page.keyboard.press(_key_for(page, 2, want[rater][2], keys))
            _at(page, 3, 3)
            page.keyboard.press(_key_for(page, 3, want[rater][3], keys))
            _until(page, "() => document.getElementById('progress').dataset.rated === '4'"
                   " && !document.getElementById('all-done').hidden")
        # The owner's view of the same page: the results report (with the run names: the owner's to see).
        page = browser.new_context().new_page()
        page.goto(url + "/rate")
        page.fill("#token", tok["owner"])
        page.click("#token-use")
        page.click(f"#studies-table tr[data-id='{sid}'] button[data-action='results']")
        report = _until(page, "() => document.getElementById('results-text').textContent")
        assert "X = run-alpha, Y = run-beta" in report and "Cohen's kappa = 0.636" in report, report
        assert page.locator(f"#studies-table tr[data-id='{sid}'] button[data-action='rate']").count() == 0
        browser.close()
    assert not problems, problems
    owner = {"Authorization": f"Bearer {tok['owner']}"}
    res = httpx.get(f"{url}/v1/studies/{sid}/results", headers=owner).json()
    assert res["per_rater"]["ann"]["win_rate_x"] == pytest.approx(2.5 / 4)
    assert res["per_rater"]["bob"]["win_rate_x"] == pytest.approx(1.5 / 4)
    assert res["pooled"]["win_rate_x"] == pytest.approx(4 / 8)
    # agreement 3/4; marginals ann x 2, y 1, tie 1; bob x 1, y 2, tie 1 -> pe = (2 + 2 + 1) / 16
    assert res["agreement"]["statistic"] == "cohen"
    assert res["agreement"]["kappa"] == pytest.approx((3 / 4 - 5 / 16) / (1 - 5 / 16))
    mine = httpx.get(f"{url}/v1/studies/{sid}/items/2", headers={"Authorization": f"Bearer {tok['ann']}"})
    mine = mine.json()
    assert mine["comment"] == "close call"
