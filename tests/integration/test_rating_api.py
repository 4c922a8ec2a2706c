"""Rating studies over the job server's API (in-process, no runner): who may see what, the blind order,
saving as you go, the bounds, the results and the preference pairs that `lmforge dpo` reads."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from lmforge.jobserver.app import create_app  # noqa: E402
from lmforge.jobserver.auth import create_token  # noqa: E402
from lmforge.jobserver.rating import MAX_ITEMS, MAX_RATERS  # noqa: E402

HOSTILE = '<script>document.title="pwned"</script><img src=x onerror=alert(1)>'
PROMPTS = [f"Question {i}: what is {i} + {i}?" for i in range(8)]
X_ANSWERS = [f"x says {2 * i}" for i in range(8)]
Y_ANSWERS = [f"y says {2 * i + 1}" for i in range(7)] + [HOSTILE]


@pytest.fixture
def api(tmp_path):
    app = create_app(tmp_path / "ws", start_runner=False)
    store = app.state.store
    with TestClient(app) as client:
        tokens = {u: {"Authorization": f"Bearer {create_token(store, u)}"}
                  for u in ("owner", "ann", "bob", "eve")}
        yield client, tokens, tmp_path / "ws"


def _create(client, tokens, **over):
    body = {"name": "blind test", "raters": ["ann", "bob"], "prompts": PROMPTS, "seed": 7,
            "x": {"label": "run-alpha", "answers": X_ANSWERS},
            # an answer file as JSONL text, as `jq -Rs` would send it
            "y": {"label": "run-beta",
                  "answers": "".join(json.dumps({"answer": a}) + "\n" for a in Y_ANSWERS)}}
    body.update(over)
    return client.post("/v1/studies", json=body, headers=tokens["owner"])


def test_raters_see_a_blind_seeded_order_and_outsiders_nothing(api):
    client, tok, _ = api
    r = _create(client, tok)
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    assert r.json()["labels"] == {"x": "run-alpha", "y": "run-beta"}
    orders = {}
    for rater in ("ann", "bob"):
        view = client.get(f"/v1/studies/{sid}", headers=tok[rater]).json()
        assert view["role"] == ["rater"] and view["next"] == 0 and view["rated"] == []
        assert "labels" not in view and "sources" not in view and "raters" not in view
        seen = []
        for i in range(len(PROMPTS)):
            item = client.get(f"/v1/studies/{sid}/items/{i}", headers=tok[rater])
            text = item.text
            assert "alpha" not in text and "beta" not in text  # no run names reach a rater
            item = item.json()
            assert item["prompt"] == PROMPTS[i] and {item["a"], item["b"]} == {X_ANSWERS[i], Y_ANSWERS[i]}
            seen.append(item["a"] == X_ANSWERS[i])
            again = client.get(f"/v1/studies/{sid}/items/{i}", headers=tok[rater]).json()
            assert again["a"] == item["a"]  # the order is fixed per rater and item
        orders[rater] = seen
        assert 0 < sum(seen) < len(seen), seen  # both orders occur
    assert orders["ann"] != orders["bob"]  # drawn per rater, not once per item
    last = client.get(f"/v1/studies/{sid}/items/7", headers=tok["ann"]).json()
    assert last["b" if orders["ann"][7] else "a"] == HOSTILE  # kept verbatim: the page inserts it as text
    # The same seed gives the same orders in a new study; the study list shows each user their studies.
    sid2 = _create(client, tok).json()["id"]
    assert [client.get(f"/v1/studies/{sid2}/items/{i}", headers=tok["ann"]).json()["a"] == X_ANSWERS[i]
            for i in range(len(PROMPTS))] == orders["ann"]
    assert [s["id"] for s in client.get("/v1/studies", headers=tok["ann"]).json()["data"]] == [sid2, sid]
    assert client.get("/v1/studies", headers=tok["eve"]).json()["data"] == []
    # Outsiders get 404 as for a missing study; the owner may not rate, a rater may not read results.
    for path in (f"/v1/studies/{sid}", f"/v1/studies/{sid}/items/0", f"/v1/studies/{sid}/results"):
        assert client.get(path, headers=tok["eve"]).status_code == 404, path
    assert client.get(f"/v1/studies/{sid}/items/0", headers=tok["owner"]).status_code == 404
    r = client.post(f"/v1/studies/{sid}/items/0", json={"choice": "A"}, headers=tok["owner"])
    assert r.status_code == 404
    for path in (f"/v1/studies/{sid}/results", f"/v1/studies/{sid}/pairs"):
        assert client.get(path, headers=tok["ann"]).status_code == 404, path
    assert client.get(f"/v1/studies/{sid}").status_code == 401
    assert client.get("/v1/studies/study-zz/items/0", headers=tok["ann"]).status_code == 404


def test_saving_is_idempotent_resumable_and_replaces(api):
    client, tok, ws = api
    sid = _create(client, tok).json()["id"]
    url = f"/v1/studies/{sid}/items/0"
    first = client.post(url, json={"choice": "A", "comment": "clearer"}, headers=tok["ann"])
    assert first.status_code == 200, first.text
    assert first.json()["rated"] == [0] and first.json()["next"] == 1
    db = sqlite3.connect(ws / "ratings.db")
    at = db.execute("SELECT updated_at FROM ratings").fetchall()
    time.sleep(0.01)
    again = client.post(url, json={"choice": "A", "comment": "clearer"}, headers=tok["ann"])
    assert again.json() == first.json()
    assert db.execute("SELECT updated_at FROM ratings").fetchall() == at  # the same choice again: no change
    got = client.get(url, headers=tok["ann"]).json()
    assert (got["choice"], got["comment"]) == ("A", "clearer")
    assert client.get(url, headers=tok["bob"]).json()["choice"] is None  # per rater
    client.post(url, json={"choice": "tie"}, headers=tok["ann"])
    assert client.get(url, headers=tok["ann"]).json()["choice"] == "tie"
    assert db.execute("SELECT COUNT(*) FROM ratings").fetchone() == (1,)
    client.post(f"/v1/studies/{sid}/items/2", json={"choice": "B"}, headers=tok["ann"])
    view = client.get(f"/v1/studies/{sid}", headers=tok["ann"]).json()
    assert view["rated"] == [0, 2] and view["next"] == 1  # a reload resumes at the first unrated item
    assert client.get(f"/v1/studies/{sid}", headers=tok["owner"]).json()["progress"] == {"ann": 2, "bob": 0}


@pytest.mark.parametrize(("over", "param"), [
    ({"prompts": ["p"] * (MAX_ITEMS + 1)}, "prompts"),
    ({"prompts": ["p" * 8001] + PROMPTS[1:]}, "prompts"),
    ({"x": {"label": "a", "answers": ["a" * 16_001] + X_ANSWERS[1:]}}, "x.answers"),
    ({"x": {"label": "a", "answers": X_ANSWERS[:3]}}, "x.answers"),
    ({"y": {"label": "b", "answers": '{"answer": 1}\n'}}, "y.answers"),
    ({"y": {"label": "b", "answers": "not json\n"}}, "y.answers"),
    ({"y": {"label": "run-alpha", "answers": Y_ANSWERS}}, "y.label"),
    ({"y": {"label": "b", "answers": Y_ANSWERS, "job": "job-0000000000000000"}}, "y"),
    ({"raters": [f"r{i}" for i in range(MAX_RATERS + 1)]}, "raters"),
    ({"raters": ["ann", "ann"]}, "raters"),
    ({"raters": ["<b>"]}, "raters"),
    ({"name": "<script>"}, "name"),
    ({"seed": -1}, "seed"),
    ({"max_new_tokens": 64}, "max_new_tokens"),  # no side is generated: refused, not ignored
    ({"colour": "red"}, "colour"),
    ({"x": {"job": "job-0123456789abcdef"}}, "x.job"),
])
def test_bad_studies_are_refused_naming_the_field(api, over, param):
    client, tok, ws = api
    r = _create(client, tok, **over)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert client.get("/v1/studies", headers=tok["owner"]).json()["data"] == []  # nothing half-made


def test_bad_ratings_are_refused(api):
    client, tok, _ = api
    sid = _create(client, tok).json()["id"]
    for body, param in (({"choice": "C"}, "choice"), ({"choice": "A", "comment": "c" * 2001}, "comment"),
                        ({"choice": "A", "extra": 1}, "choice")):
        r = client.post(f"/v1/studies/{sid}/items/0", json=body, headers=tok["ann"])
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = client.post(f"/v1/studies/{sid}/items/8", json={"choice": "A"}, headers=tok["ann"])
    assert r.status_code == 404 and r.json()["error"]["param"] == "index"
    assert client.post(f"/v1/studies/{sid}/items/0", content=b"{", headers=tok["ann"]).status_code == 400


def test_results_and_pairs_feed_dpo(api, tmp_path):
    from lmforge.data.preference import read_pairs

    client, tok, _ = api
    sid = _create(client, tok).json()["id"]
    # ann prefers X on items 0-5 and ties 6-7; bob prefers X on 0-3, Y on 4-7. Choices are sent as the
    # letters each rater saw, so this also checks the letter -> run mapping.
    want = {"ann": ["x"] * 6 + ["tie"] * 2, "bob": ["x"] * 4 + ["y"] * 4}
    sent = []
    for rater, winners in want.items():
        for i, w in enumerate(winners):
            shown = client.get(f"/v1/studies/{sid}/items/{i}", headers=tok[rater]).json()
            x_is_a = shown["a"] == X_ANSWERS[i]
            choice = "tie" if w == "tie" else ("A" if (w == "x") == x_is_a else "B")
            sent.append(choice)
            assert client.post(f"/v1/studies/{sid}/items/{i}", json={"choice": choice},
                               headers=tok[rater]).status_code == 200
    res = client.get(f"/v1/studies/{sid}/results", headers=tok["owner"]).json()
    assert res["x"] == "run-alpha" and res["per_rater"]["ann"]["win_rate_x"] == pytest.approx(7 / 8)
    assert res["per_rater"]["bob"]["win_rate_x"] == pytest.approx(0.5)
    assert res["pooled"]["win_rate_x"] == pytest.approx(11 / 16)
    assert res["position"] == {k: sent.count(k) for k in ("A", "B", "tie")}
    lo, hi = res["pooled"]["ci95"]
    assert lo < 11 / 16 < hi
    # Cohen's kappa by hand: agreement 4/8; ann's marginals x 6/8, tie 2/8; bob's x 4/8, y 4/8 -> pe 3/8
    assert res["agreement"]["statistic"] == "cohen"
    assert res["agreement"]["kappa"] == pytest.approx((0.5 - 3 / 8) / (1 - 3 / 8))
    md = client.get(f"/v1/studies/{sid}/results?format=markdown", headers=tok["owner"])
    assert md.headers["content-type"].startswith("text/markdown") and "| pooled | 16 |" in md.text
    pairs = client.get(f"/v1/studies/{sid}/pairs", headers=tok["owner"])
    assert "attachment" in pairs.headers["content-disposition"]
    path = tmp_path / "pairs.jsonl"
    path.write_text(pairs.text)
    loaded = list(read_pairs([str(path)], on_bad="fail"))  # the loader `lmforge dpo` reads its data with
    # items 0-3: both chose X; 4-5: ann X, bob Y (even: skipped); 6-7: a tie and Y -> Y
    assert len(loaded) == 6
    assert loaded[0].chosen[-1]["content"] == X_ANSWERS[0]
    assert loaded[0].rejected[-1]["content"] == Y_ANSWERS[0]
    first = json.loads(pairs.text.splitlines()[0])
    assert first == {"prompt": PROMPTS[0], "chosen": X_ANSWERS[0], "rejected": Y_ANSWERS[0]}
    assert json.loads(pairs.text.splitlines()[-1])["chosen"] == HOSTILE
    assert client.delete(f"/v1/studies/{sid}", headers=tok["ann"]).status_code == 404
    assert client.delete(f"/v1/studies/{sid}", headers=tok["owner"]).json()["deleted"] is True
    assert client.get(f"/v1/studies/{sid}", headers=tok["ann"]).status_code == 404


def test_rate_page_is_served_locked_down_and_never_assigns_html(api):
    from lmforge.jobserver.dashboard import CSP, STATIC

    client, _, _ = api
    page = client.get("/rate")
    assert page.status_code == 200 and page.headers["content-security-policy"] == CSP
    assert page.text == (STATIC / "rate.html").read_text()
    js = client.get("/static/rate.js")
    assert js.status_code == 200
    assert "innerHTML" not in js.text and "outerHTML" not in js.text and "insertAdjacentHTML" not in js.text


def test_answers_generated_from_a_finished_train_job(tmp_path, tiny_cfg):
    """x: {"job"}: the server writes the run's greedy replies in the background; the study is rateable once
    they are in, and a server that stops mid-way leaves the study failed, not half-filled and ready."""
    from lmforge.jobserver.rating import RatingStore
    from lmforge.jobserver.rating_gen import generate_answers
    from lmforge.jobserver.store import Job
    from lmforge.train.trainer import train

    ws = tmp_path / "ws"
    app = create_app(ws, start_runner=False)
    store = app.state.store
    job = Job(id="job-00000000000000a1", user="owner", kind="train", name="tiny", status="succeeded",
              created_at=time.time(), queued_at=time.time())
    train(tiny_cfg("train.max_steps=2", f"run.dir={ws / 'jobs' / job.id / 'run'}"))
    store.add_job(job)
    prompts = ["Tell me a story.", "Why is the sky blue?"]
    with TestClient(app) as client:
        tok = {u: {"Authorization": f"Bearer {create_token(store, u)}"} for u in ("owner", "ann")}
        r = client.post("/v1/studies", headers=tok["owner"], json={
            "raters": ["ann"], "prompts": prompts, "max_new_tokens": 8, "x": {"job": job.id},
            "y": {"label": "reference", "answers": ["Once.", "Rayleigh scattering."]}})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        assert r.json()["labels"]["x"] == job.id
        deadline = time.monotonic() + 120
        url = f"/v1/studies/{sid}"
        while (view := client.get(url, headers=tok["owner"]).json())["status"] == "generating":
            early = client.get(f"/v1/studies/{sid}/items/0", headers=tok["ann"]).status_code
            # 409 while generating; 200 only where the answers landed between the two requests, the study
            # then no longer generating (an item served while it still is would fail here)
            assert early == 409 or (early == 200 and client.get(url, headers=tok["owner"]).json()["status"]
                                    != "generating"), early
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert view["status"] == "ready", view
        item = client.get(f"/v1/studies/{sid}/items/1", headers=tok["ann"]).json()
        generated = item["b"] if item["a"] == "Rayleigh scattering." else item["a"]
        assert generated == generate_answers(ws / "jobs" / job.id / "run", prompts, 8)[1]
        bad = client.post("/v1/studies", headers=tok["owner"], json={
            "raters": ["ann"], "prompts": prompts, "x": {"job": "job-00000000000000b2"},
            "y": {"answers": ["a", "b"]}})
        assert bad.status_code == 404 and bad.json()["error"]["param"] == "x.job"
        running = Job(id="job-00000000000000c3", user="owner", kind="train", name="t", status="running",
                      created_at=time.time(), queued_at=time.time())
        (ws / "jobs" / running.id / "run" / "checkpoints").mkdir(parents=True)
        store.add_job(running)
        bad = client.post("/v1/studies", headers=tok["owner"], json={
            "raters": ["ann"], "prompts": prompts, "x": {"answers": ["a", "b"]}, "y": {"job": running.id}})
        assert bad.status_code == 409 and bad.json()["error"]["param"] == "y.job", bad.text
    db = sqlite3.connect(ws / "ratings.db")
    db.execute("UPDATE studies SET status = 'generating'")
    db.commit()
    RatingStore(ws).close()  # a restarted server
    assert db.execute("SELECT status FROM studies").fetchone() == ("failed",)
