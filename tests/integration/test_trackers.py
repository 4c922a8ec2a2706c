"""MLflow and W&B trackers on a tiny run, read back with each tracker's own API: params are the resolved
config, each metric's history is metrics.jsonl's, the final artifacts are there; a resumed run continues
the same tracker runs; a missing package is refused (exit 2, the install hint) before the run dir is
touched."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import yaml

from conftest import TINY, CrashAt, tiny_overrides
from lmforge.cli import main
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import Trainer, train

TRACKERS = ("logging.mlflow.enabled=true", "logging.wandb.enabled=true")
# Timing and memory differ between two sessions; these are the same after a deterministic resume.
DETERMINISTIC = ("loss", "lr", "grad_norm", "tokens_seen", "val_loss", "val_ppl", "val_bpb")


def expected_params(run: Path) -> dict[str, str]:
    """config.yaml as MLflow params: dotted keys, strings as they are, other values as JSON."""
    out = {}

    def walk(node, prefix):
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node if isinstance(node, str) else json.dumps(node)

    walk(yaml.safe_load((run / "config.yaml").read_text()), "")
    return out


def jsonl_history(run: Path) -> dict[str, list[tuple[int, float]]]:
    """metric -> [(step, value)] from metrics.jsonl (events left out: they have no train metrics)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in read_metrics(run / "metrics.jsonl"):
        if "event" in r:
            continue
        for k, v in r.items():
            if k != "step":
                out.setdefault(k, []).append((r["step"], float(v)))
    return out


# -- MLflow: MlflowClient on the file store -------------------------------------------------------
def mlflow_run(run: Path):
    from mlflow.tracking import MlflowClient

    state = json.loads((run / "trackers.json").read_text())["mlflow"]
    assert state["tracking_uri"] == (run / "mlruns").resolve().as_uri()
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    return client, client.get_run(state["run_id"])


def mlflow_history(client, run_id: str, keys) -> dict[str, list[tuple[int, float]]]:
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k.replace("/", ".")))
            for k in keys}


# -- W&B: the offline run's records (the LevelDB-style log wandb-core writes, Record protobufs) ----
def wandb_records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, buf = 7, b""  # header: magic, a 2-byte id, a version byte
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # the rest of a block is padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def key(item) -> str:
    return item.key or "/".join(item.nested_key)  # wandb-core writes most keys as a nested_key


def wandb_sessions(run: Path) -> list[dict]:
    """Each offline session of the run (oldest first): id, config, history rows, summary, files, exit."""
    out = []
    for f in sorted((run / "wandb").glob("offline-run-*/run-*.wandb")):
        s = {"dir": f.parent, "rows": [], "summary": {}, "exit": None, "config": {}}
        for rec in wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                s["id"] = rec.run.run_id
                s["config"].update({key(i): json.loads(i.value_json) for i in rec.run.config.update})
            elif kind == "config":
                s["config"].update({key(i): json.loads(i.value_json) for i in rec.config.update})
            elif kind == "history":
                s["rows"].append({key(i): json.loads(i.value_json) for i in rec.history.item})
            elif kind == "summary":
                s["summary"].update({key(i): json.loads(i.value_json) for i in rec.summary.update})
            elif kind == "exit":
                s["exit"] = rec.exit.exit_code
        out.append(s)
    return out


def wandb_history(sessions: list[dict], keys) -> dict[str, list[tuple[int, float]]]:
    rows = [r for s in sessions for r in s["rows"]]
    return {k: [(r["_step"], float(r[k])) for r in rows if k in r] for k in keys}


def unwrap(config: dict) -> dict:
    """W&B keeps each top-level config key as {"value": ...} (wandb's config.yaml layout)."""
    return {k: v["value"] if isinstance(v, dict) and set(v) == {"value"} else v for k, v in config.items()
            if not k.startswith("_")}


def test_mlflow_and_wandb_read_back(tiny_cfg, tmp_path):
    train(tiny_cfg("train.max_steps=6", "train.log_every=2", "train.eval_every=3", "checkpoint.every=3",
                   "run.name=tracked", *TRACKERS))
    run = tmp_path / "run"
    want = jsonl_history(run)
    assert {"loss", "lr", "val_loss", "grad_norm/decay"} <= want.keys()
    assert [s for s, _ in want["loss"]] == [2, 4, 6] and [s for s, _ in want["val_loss"]] == [3, 6]
    final_ckpt = str((run / "checkpoints" / "step_00000006").resolve())

    client, mr = mlflow_run(run)
    assert mr.info.status == "FINISHED" and mr.info.run_name == "tracked"
    assert mr.data.params == expected_params(run)
    assert mlflow_history(client, mr.info.run_id, want) == want  # every metric, every step, exact
    assert len(mr.data.metrics) == len(want)
    assert sorted(a.path for a in client.list_artifacts(mr.info.run_id)) == \
        ["config.yaml", "curves.png", "metrics.jsonl"]
    local = Path(client.download_artifacts(mr.info.run_id, "metrics.jsonl", str(tmp_path)))
    assert local.read_bytes() == (run / "metrics.jsonl").read_bytes()
    assert mr.data.tags["final_checkpoint"] == final_ckpt

    (ws,) = wandb_sessions(run)
    assert ws["id"] == json.loads((run / "trackers.json").read_text())["wandb"]["run_id"]
    assert unwrap(ws["config"]) == yaml.safe_load((run / "config.yaml").read_text())
    assert wandb_history([ws], want) == want
    assert [r["_step"] for r in ws["rows"]] == [2, 3, 4, 6]  # train and val records of a step: one row
    files = ws["dir"] / "files"
    for name in ("config.yaml", "curves.png", "metrics.jsonl"):
        assert (files / name).read_bytes() == (run / name).read_bytes()
    assert ws["summary"]["final_checkpoint"] == final_ckpt and ws["exit"] == 0


def test_resume_continues_the_tracker_runs(tiny_cfg, tmp_path):
    cfg = tiny_cfg("train.max_steps=8", "train.log_every=1", "checkpoint.every=3", *TRACKERS)
    with pytest.raises(Exception, match="crash after step 5"):
        Trainer(cfg, callbacks=[CrashAt(5)]).fit()
    run = tmp_path / "run"
    first = json.loads((run / "trackers.json").read_text())
    client, mr = mlflow_run(run)
    assert mr.info.status == "FAILED"
    assert [s for s, _ in mlflow_history(client, mr.info.run_id, ["loss"])["loss"]] == [1, 2, 3, 4, 5]

    Trainer(cfg, resume=True).fit()  # from step 3: steps 4 and 5 are redone
    state = json.loads((run / "trackers.json").read_text())
    assert state["mlflow"]["run_id"] == first["mlflow"]["run_id"]
    assert state["wandb"]["run_id"] == first["wandb"]["run_id"]
    want = jsonl_history(run)
    assert [s for s, _ in want["loss"]] == list(range(1, 9))

    client, mr = mlflow_run(run)
    assert mr.info.status == "FINISHED" and mr.data.params == expected_params(run)
    got = mlflow_history(client, mr.info.run_id, want)
    assert {k: [s for s, _ in v] for k, v in got.items()} == {k: [s for s, _ in v] for k, v in want.items()}
    assert {k: got[k] for k in DETERMINISTIC if k in want} == {k: want[k] for k in DETERMINISTIC if k in want}

    sessions = wandb_sessions(run)
    assert [s["id"] for s in sessions] == [first["wandb"]["run_id"]] * 2
    assert [s["exit"] for s in sessions] == [1, 0]
    got = wandb_history(sessions, want)
    assert [r["_step"] for s in sessions for r in s["rows"]] == list(range(1, 9))  # no step twice
    assert {k: got[k] for k in DETERMINISTIC if k in want} == {k: want[k] for k in DETERMINISTIC if k in want}
    resumed_files = sessions[1]["dir"] / "files"
    assert (resumed_files / "metrics.jsonl").read_bytes() == (run / "metrics.jsonl").read_bytes()


@pytest.mark.parametrize("package", ["mlflow", "wandb"])
def test_missing_package_exits_2_with_the_extra(package, tmp_path, shared_data_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, package, None)  # `import <package>` raises ImportError
    setting = f"logging.{package}.enabled"
    run = tmp_path / "run"
    args = ["train", "-c", str(TINY)]
    for o in tiny_overrides(run, shared_data_dir, "train.max_steps=2", f"{setting}=true"):
        args += ["--set", o]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"pip install 'lmforge[{package}]'" in err and f"{setting}=false" in err
    assert "Traceback" not in err
    assert not run.exists()  # refused before the run dir was made


def test_damaged_or_foreign_trackers_json_starts_new_runs(tmp_path):
    from lmforge.metrics.trackers import _read_state, record_items

    for text in ("{not json", "[1, 2]", '{"mlflow": {"run_id": "../../elsewhere", "logged": {}}}',
                 '{"wandb": {"run_id": 7}}', '{"mlflow": {"run_id": "abc", "logged": [1]}}'):
        (tmp_path / "trackers.json").write_text(text)
        assert _read_state(tmp_path) == {}, text
    (tmp_path / "trackers.json").write_text(
        '{"wandb": {"run_id": "ab12", "logged": {"loss": 4, "lr": "x", "val_loss": true}}}')
    assert _read_state(tmp_path)["wandb"]["logged"] == {"loss": 4}
    # events keep their fields apart from the train metrics of the same step; strings and NaN are left out
    spike = {"step": 3, "event": "loss_spike", "loss": 9.5, "action": "skip", "z": float("nan")}
    assert record_items(spike) == {"event/loss_spike/loss": 9.5}
    assert record_items({"step": 3, "loss": 2, "ok": True}) == {"loss": 2.0}
