"""The dashboard in headless Chromium (Playwright driving Debian's `chromium`) against a real `lmforge
server`: enter a token, submit the tiny recipe through the form, watch the loss chart gain points while it
trains, cancel, resume, see it succeed with every step charted, export it, diff two runs' configs, and
check that a server message with markup is shown as text. A screenshot of the chart must show the curve.

scripts/test.sh installs Chromium where it can (apt-get as root or through sudo); where it cannot, the
test is skipped and says what to install (.ci/run fails on that skip: CI must run it)."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import CORPUS, TINY
from lmforge.config import load_config
from lmforge.data import prepare

CHROMIUM = "/usr/bin/chromium"
MAX_STEPS = 120  # long enough that the page sees it running and cancels it well before the end
LOSS_RGB = (0x1F, 0x77, 0xB4)  # the train-loss stroke of the loss chart (static/app.js)


def _playwright():
    """Playwright's sync API and the Chromium to drive, or a failure that says what to install."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the dashboard browser test needs Playwright for Python: pip install playwright (it is "
                    "in lmforge's test extras: pip install -e '.[test]')", pytrace=False)
    exe = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    if exe is None:
        pytest.skip("the dashboard browser test needs Debian's Chromium at /usr/bin/chromium: "
                    "apt-get install -y chromium (scripts/test.sh does this where it can); `playwright "
                    "install` cannot download browsers here")
    return sync_playwright, exe


def _token(ws: Path, user: str) -> str:
    cmd = [sys.executable, "-m", "lmforge", "jobs", "token", "create", "--workspace", str(ws),
           "--user", user]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


def _tiny_yaml(ws: Path, **train) -> str:
    """configs/debug/tiny.yaml on the prepared shipped corpus: the text a user would paste."""
    cfg = yaml.safe_load(TINY.read_text())
    cfg["data"].update({"sources": [str(CORPUS)], "dir": str(ws / "data"), "max_chars": None})
    cfg["logging"]["progress"] = "none"
    cfg["train"].update(train)
    return yaml.safe_dump(cfg)


@pytest.fixture(scope="module")
def browser():
    sync_playwright, exe = _playwright()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from lmforge.jobserver.server import server_process

    ws = tmp_path_factory.mktemp("dash_ws")
    prepare(load_config(TINY, [f"run.dir={ws / 'prep'}", f"data.dir={ws / 'data'}",
                               f"data.sources=[{CORPUS}]", "data.max_chars=null", "logging.progress=none"]),
            console=lambda m: None)
    with server_process(ws, "--max-running", "2", "--allow-root", str(CORPUS.parent)) as srv:
        yield ws, srv.url, _token(ws, "alice")


def _points(page) -> int:
    return int(page.get_attribute("#chart-loss", "data-points") or 0)


def _until(page, js: str, arg=None, timeout_s: float = 30.0):
    """Poll `js` (a function of `arg`) in the page until it is truthy. (Playwright's wait_for_function
    evaluates strings, which the page's Content-Security-Policy forbids, as it should.)"""
    deadline = time.monotonic() + timeout_s
    while True:
        got = page.evaluate(js, arg)
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {js} ({arg})"
        time.sleep(0.1)


def _selected_other_than(page, ids: list[str]) -> str:
    """The id of the run the page selected (it selects each run it submits), once it is none of `ids`."""
    return _until(page, "ids => { const r = document.querySelector('#runs-table tbody tr.selected');"
                  " return r && !ids.includes(r.dataset.id) ? r.dataset.id : null; }", ids)


def _wait_status(page, status: str, timeout_s: float) -> None:
    _until(page, "s => document.getElementById('detail-status').textContent === s", status, timeout_s)


def _curve_pixels(png: bytes) -> tuple[float, int]:
    """(grey-level standard deviation, pixels within 40 of the loss stroke's colour) of a screenshot."""
    import numpy as np
    from PIL import Image

    img = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.int64)  # (H, W, 3)
    grey = np.asarray(Image.open(io.BytesIO(png)).convert("L"), dtype=np.float64)
    near = int((np.abs(img - np.array(LOSS_RGB)).sum(-1) <= 40).sum())
    return float(grey.std()), near


@pytest.mark.slow  # 38 s on 2 cores: the slow tier (CI), keeping the default suite near 15 min
def test_dashboard_drives_a_run_in_chromium(browser, served, tmp_path):
    ws, url, token = served
    t0 = time.monotonic()
    page = browser.new_page(viewport={"width": 1280, "height": 1400})
    problems: list[str] = []  # script errors and CSP violations would show up here
    page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
    page.on("console", lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None)
    page.goto(url + "/")
    assert page.title() == "lmforge dashboard"

    # A wrong token is refused and forgotten; the real one lists (no) runs.
    page.fill("#token", "lmf_000000000000_" + "x" * 43)
    page.click("#token-use")
    page.wait_for_selector("#message.error")
    assert "refused the token" in page.text_content("#message")
    assert page.text_content("#token-state") == "no token"
    problems.clear()  # the 401 above is logged by the browser as a failed resource load
    page.fill("#token", token)
    page.click("#token-use")
    _until(page, "() => document.getElementById('token-state').textContent === 'token set'")
    assert page.evaluate("sessionStorage.getItem('lmforge.token')") == token

    # Submit the tiny recipe through the form; the page selects the new run and streams its metrics.
    page.fill("#run-name", "browser run")
    page.fill("#config", _tiny_yaml(ws, max_steps=MAX_STEPS, eval_every=30))
    page.click("#submit-run")
    job_id = _selected_other_than(page, [])
    assert job_id.startswith("job-")
    _until(page, "() => document.getElementById('chart-loss').dataset.points >= 2", timeout_s=60)
    first = _points(page)
    _until(page, "n => document.getElementById('chart-loss').dataset.points > n", first)
    grown = _points(page)
    assert first < grown < MAX_STEPS, (first, grown)  # the chart gained points while it trained
    row = f"#runs-table tbody tr[data-id='{job_id}']"
    assert page.get_attribute(row, "data-status") == "running"  # the stream's status events reach the table

    # Cancel: the run stops at a checkpoint; resume: it goes on to the end, every step on the chart.
    page.click("#btn-cancel")
    _wait_status(page, "cancelled", 30)
    assert page.is_enabled("#btn-resume") and not page.is_enabled("#btn-cancel")
    ckpts = sorted((ws / "jobs" / job_id / "run" / "checkpoints").iterdir())
    stopped = int(ckpts[-1].name.split("_")[1])
    assert 0 < stopped < MAX_STEPS
    page.click("#btn-resume")
    _wait_status(page, "succeeded", 90)
    _until(page, "n => document.getElementById('chart-loss').dataset.points == n", MAX_STEPS, 10)
    cells = page.locator(f"{row} td").all_text_contents()
    assert cells[3] == "succeeded" and cells[4] == f"{MAX_STEPS}/{MAX_STEPS} (100%)", cells
    assert "attempt 2" in page.text_content("#detail-line")
    log = page.text_content("#log")
    assert log.strip(), "the log tail is empty"
    page.wait_for_selector("#artifacts button:text-is('metrics.jsonl')")

    # The chart shows the curve: a non-blank screenshot with the loss stroke's colour in it.
    png = page.locator("#chart-loss").screenshot()
    (tmp_path / "chart-loss.png").write_bytes(png)
    std, near = _curve_pixels(png)
    assert std > 10 and near > 200, (std, near)
    shot = page.screenshot(full_page=True)
    (tmp_path / "dashboard.png").write_bytes(shot)
    page_std, _ = _curve_pixels(shot)
    assert page_std > 10

    # Export: an export job of the run appears and succeeds. Meanwhile a second run with overrides (the
    # diff compares the two once both have resolved their configs: a queued run's vocab_size is null).
    page.click("#btn-export")
    page.wait_for_selector("#runs-table tbody tr td:text-is('export')")
    export_id = page.evaluate("[...document.querySelectorAll('#runs-table tbody tr')]"
                              ".find(r => r.cells[2].textContent === 'export').dataset.id")
    page.fill("#run-name", "short run")
    page.fill("#sets", "train.max_steps=3\noptim.lr=0.001")
    page.click("#submit-run")
    second = _selected_other_than(page, [job_id, export_id])
    _until(page, "() => document.querySelectorAll('#diff-a option').length === 2")
    for done in (export_id, second):
        _until(page, "r => document.querySelector(r).dataset.status === 'succeeded'",
               f"#runs-table tr[data-id='{done}']", 60)
    page.select_option("#diff-a", job_id)
    page.select_option("#diff-b", second)
    page.click("#diff-go")
    page.wait_for_selector("#diff-table tbody tr[data-key='train.max_steps']")
    diff = {r.get_attribute("data-key"): r.locator("td").all_text_contents()[1:]
            for r in page.locator("#diff-table tbody tr").all()}
    assert diff["train.max_steps"] == [str(MAX_STEPS), "3"] and diff["optim.lr"] == ["0.003", "0.001"]
    assert diff["run.dir"][0] != diff["run.dir"][1]
    # only what changed: the two edits, and the outputs the server puts in each job's own dir
    assert set(diff) == {"train.max_steps", "optim.lr", "run.dir", "curate.output_dir"}, sorted(diff)
    assert all(job in v for job, v in zip((job_id, second), diff["curate.output_dir"]))

    # Server text is shown as text: an unknown key with markup comes back in the 422 message verbatim.
    page.fill("#sets", "")
    page.fill("#config", _tiny_yaml(ws) + '"<img src=x id=injected>": 1\n')
    page.click("#submit-run")
    page.wait_for_selector("#message.error")
    assert "<img src=x id=injected>" in page.text_content("#message")
    assert page.locator("#injected").count() == 0 and page.locator("#message img").count() == 0
    problems = [p for p in problems if "422" not in p]  # the refused submission's failed load
    assert not problems, problems
    assert time.monotonic() - t0 < 120


def test_page_and_files_need_no_token_and_carry_a_strict_policy(tmp_path):
    """The page and its files are public (they hold no data) and locked down; the API behind stays closed."""
    from fastapi.testclient import TestClient

    from lmforge.jobserver.app import create_app
    from lmforge.jobserver.dashboard import CSP, STATIC

    client = TestClient(create_app(tmp_path / "ws", start_runner=False))
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.text == (STATIC / "index.html").read_text()
    for path in ("/", "/static/app.js", "/static/app.css", "/static/vendor/uPlot.iife.min.js"):
        r = client.get(path)
        assert r.status_code == 200, path
        assert r.headers["content-security-policy"] == CSP, path
        assert r.headers["x-content-type-options"] == "nosniff", path
    assert "script-src 'self';" in CSP and "unsafe" not in CSP
    assert client.get("/static/vendor/uPlot.LICENSE").text.startswith("The MIT License")
    for bad in ("/static/../app.py", "/static/%2e%2e/app.py", "/static/..%2fdashboard.py", "/static/nope.js"):
        assert client.get(bad).status_code == 404, bad
    assert client.get("/v1/jobs").status_code == 401
    # Data reaches the page as text only: the script never assigns HTML.
    js = (STATIC / "app.js").read_text()
    assert "innerHTML" not in js and "outerHTML" not in js and "insertAdjacentHTML" not in js
