"""The Python API: lmforge.Trainer on a config, and on a user's own module, datasets, tokenizer and
callbacks. The reference for a user's module is the plain PyTorch loop such a user would write."""

from __future__ import annotations

import copy
import json
import re
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lmforge
from lmforge.assembly import check_layout
from lmforge.config import load_config
from lmforge.config.schema import Config, ParallelConfig
from lmforge.data import TokenLoader, prepare
from lmforge.data.memory import token_stream
from lmforge.engine.objectives import CausalLM
from lmforge.errors import ConfigError, LmforgeError
from lmforge.metrics.loggers import read_metrics
from lmforge.parallel.dims import ParallelDims

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests" / "data" / "pydoc_topics.jsonl"


class GRULM(nn.Module):
    """Embedding -> GRU -> linear head: a language model that is nothing like lmforge's Transformer."""

    def __init__(self, vocab: int, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = nn.GRU(d, d, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(ids))[0])  # (B, T, vocab)


def texts(n: int | None = None) -> list[str]:
    rows = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]
    return rows[:n] if n else rows


def byte_docs(n: int = 40) -> list[list[int]]:
    return [list(t.encode()) for t in texts(n)]


def sdk_config(run_dir: Path, **train) -> dict:
    return {
        "run": {"dir": str(run_dir)},
        "optim": {"lr": 1e-2},
        "schedule": {"name": "constant", "warmup_steps": 0},
        "train": {
            "max_steps": 6,
            "seq_len": 32,
            "micro_batch_size": 4,
            "precision": "fp32",
            "log_every": 1,
            "eval_every": 0,
            "eval_batches": 2,
            "threads": 1,
            **train,
        },
        "checkpoint": {"every": 0},
        "logging": {"progress": "none", "plot": False},
    }


def test_own_module_equals_the_plain_pytorch_loop(tmp_path):
    """The Trainer on a user's module and token-id documents takes exactly the steps of the loop a
    user writes by hand: same windows, mean cross-entropy, AdamW (no decay on embeddings, norms,
    biases), clip 1.0. Measured: losses equal to ~1e-7 relative (tolerance 1e-6)."""
    docs = byte_docs()
    torch.manual_seed(0)
    model = GRULM(256)
    ref = copy.deepcopy(model)
    trainer = lmforge.Trainer(model=model, train_data=docs, config=sdk_config(tmp_path / "run"))
    final = trainer.fit()
    assert trainer.model is model  # the user's own object was trained
    logged = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]

    loader = TokenLoader([token_stream(docs, None, "docs")], 32, 4, seed=trainer.cfg.run.seed)
    decay = [p for n, p in ref.named_parameters() if p.ndim >= 2 and not n.startswith("emb.")]
    rest = [p for n, p in ref.named_parameters() if not (p.ndim >= 2 and not n.startswith("emb."))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    expected = []
    for _ in range(6):
        x, y = loader.next_batch()
        loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        expected.append(loss.item())
    assert logged == pytest.approx(expected, rel=1e-6)
    assert final["step"] == 6 and final["train_loss"] == pytest.approx(expected[-1], rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000006"
    assert (ckpt / "meta.json").is_file()
    # The checkpoint loads back into the user's module; the verbs that rebuild lmforge's model say so.
    from lmforge.checkpoint.manager import load_states
    from lmforge.cli import main

    again = GRULM(256)
    assert load_states(ckpt, again) == 6
    for p, q in zip(again.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert main(["eval", str(tmp_path / "run")]) == 2


def test_texts_with_a_tokenizer_and_eval_data(tiny_cfg, tmp_path):
    """Texts encoded by the user's tokenizer (a path to tokenizer.json), validation on held-out texts
    with bits per byte, and a Hugging Face module (its output object's .logits)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    data = prepare(tiny_cfg(), console=lambda *_: None)  # a tokenizer.json to hand over
    vocab = data.tokenizer.vocab_size
    torch.manual_seed(0)
    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )
    corpus = texts()
    trainer = lmforge.Trainer(model=hf, train_data=corpus[8:], eval_data=corpus[:8],
                              tokenizer=data.dir / "tokenizer.json",
                              config=sdk_config(tmp_path / "run", max_steps=8, eval_every=4))
    final = trainer.fit()
    assert final["step"] == 8 and 0 < final["bpb"] < 10 and final["loss"] < 5.8  # ln(512) = 6.24 at the start
    val = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in val] == [4, 8] and val[-1]["val_loss"] == pytest.approx(final["loss"])


def test_texts_without_a_tokenizer_train_one(tmp_path):
    cfg = sdk_config(tmp_path / "run", max_steps=2)
    cfg["data"] = {"tokenizer": {"vocab_size": 300}}
    said = []
    trainer = lmforge.Trainer(model=GRULM(300), train_data=texts(20), config=cfg,
                              console=_Console(said))
    trainer.fit()
    assert any("training a 300-token byte-level BPE" in s for s in said)
    assert trainer.run.tokenizer.vocab_size == 300


class _Console:
    """Collects what the Trainer says (the Console interface the loop uses)."""

    def __init__(self, out: list[str]) -> None:
        self.out = out

    def __call__(self, msg: str) -> None:
        self.out.append(msg)

    print = warn = __call__

    def start(self, total: int, completed: int = 0) -> None: ...

    def step(self, step: int) -> None: ...

    def log(self, record: dict, total: int) -> None: ...

    def stop(self) -> None: ...


class Recorder(lmforge.Callback):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_train_start(self, trainer):
        self.events.append(("start", trainer.step))

    def on_step_end(self, trainer, step, result):
        self.events.append(("step", step))

    def on_evaluate(self, trainer, metrics):
        self.events.append(("evaluate", metrics["step"]))

    def on_save(self, trainer, path):
        self.events.append(("save", path.name))

    def on_train_end(self, trainer, metrics):
        self.events.append(("end", metrics["step"] if metrics else None))


class Steer(lmforge.Callback):
    """Halves the lr after step 3 and stops the run after step 6."""

    def on_step_end(self, trainer, step, result):
        if step == 3:
            trainer.lr_scale *= 0.5
        if step == 6:
            trainer.request_stop("enough", at=step)


class Counter(lmforge.Callback):
    """A Stateful callback: its count is checkpointed and restored on resume."""

    state_key = "counter"

    def __init__(self) -> None:
        self.n = 0

    def on_step_end(self, trainer, step, result):
        self.n += 1

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def test_callback_events_stop_and_lr_scale(tmp_path):
    rec = Recorder()
    cfg = sdk_config(tmp_path / "run", max_steps=20, eval_every=4)
    cfg["checkpoint"] = {"every": 5}
    trainer = lmforge.Trainer(model=GRULM(256), train_data=byte_docs(), eval_data=byte_docs(6),
                              config=cfg, callbacks=[rec, Steer()])
    final = trainer.fit()
    assert final["step"] == 6 == trainer.step
    assert rec.events == [("start", 0), ("step", 1), ("step", 2), ("step", 3), ("step", 4), ("evaluate", 4),
                          ("step", 5), ("save", "step_00000005"), ("step", 6), ("save", "step_00000006"),
                          ("evaluate", 6), ("end", 6)]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    lrs = {r["step"]: r["lr"] for r in records if "lr" in r}
    assert lrs[3] == 1e-2 and lrs[4] == 5e-3 and lrs[6] == 5e-3  # from the step after the request
    assert [r for r in records if r.get("event") == "enough"] == [{"step": 6, "event": "enough", "at": 6}]


def test_stateful_callback_and_lr_scale_survive_resume(tmp_path):
    cfg = sdk_config(tmp_path / "run", max_steps=4)
    cfg["checkpoint"] = {"every": 2}
    first = Counter()
    trainer = lmforge.Trainer(model=GRULM(256), train_data=byte_docs(), config=cfg, callbacks=[first])
    trainer.lr_scale = 0.25
    trainer.fit()
    cfg["train"]["max_steps"] = 6
    again = Counter()
    resumed = lmforge.Trainer(
        model=GRULM(256), train_data=byte_docs(), config=cfg, callbacks=[again], resume=True
    )
    assert resumed.step == 4 and again.n == 4 and resumed.lr_scale == 0.25
    resumed.fit()
    assert again.n == 6


def test_trainer_on_a_config_is_lmforge_train(tiny_cfg, tmp_path):
    """lmforge.Trainer(config) with a Config, a YAML path or a dict runs the same run as the CLI."""
    from lmforge.train.trainer import train

    a = train(tiny_cfg("train.max_steps=4", f"run.dir={tmp_path / 'cli'}"))
    b = lmforge.Trainer(tiny_cfg("train.max_steps=4", f"run.dir={tmp_path / 'sdk'}")).fit()
    assert a == b
    curve = [r["loss"] for r in read_metrics(tmp_path / "cli" / "metrics.jsonl") if "loss" in r]
    assert curve == [r["loss"] for r in read_metrics(tmp_path / "sdk" / "metrics.jsonl") if "loss" in r]


def test_unfit_models_and_layouts_are_clear_errors(tmp_path):
    with pytest.raises(
        LmforgeError, match=r"predicts 100 token ids but the data uses \d+; give it an output layer"
    ):
        lmforge.Trainer(model=GRULM(100), train_data=byte_docs(), config=sdk_config(tmp_path / "a"))
    with pytest.raises(LmforgeError, match=r"returned logits of shape \(2, 3\)"):
        lmforge.Trainer(model=_Flat(), train_data=byte_docs(), config=sdk_config(tmp_path / "b"))
    with pytest.raises(ConfigError, match="needs a model whose forward takes `head=`"):
        lmforge.Trainer(model=GRULM(256), train_data=byte_docs(),
                        config=sdk_config(tmp_path / "c", loss_chunk_tokens=64))
    with pytest.raises(ConfigError, match="model.init_from loads weights into lmforge's Transformer"):
        lmforge.Trainer(model=GRULM(256), train_data=byte_docs(),
                        config={**sdk_config(tmp_path / "d"), "model": {"init_from": str(tmp_path)}})
    dims = ParallelDims.resolve(ParallelConfig(dp_shard=2), 2)
    with pytest.raises(ConfigError, match="a model object of your own trains on one process or with DDP"):
        check_layout(Config(), dims, CausalLM(), custom_model=True)
    check_layout(
        Config(), ParallelDims.resolve(ParallelConfig(dp_replicate=2), 2), CausalLM(), custom_model=True
    )
    with pytest.raises(LmforgeError, match=r"train_data\[1\]: token ids must be >= 0"):
        lmforge.Trainer(model=GRULM(256), train_data=[[1, 2], [3, -1]], config=sdk_config(tmp_path / "e"))
    with pytest.raises(ConfigError, match="expected a Config, a YAML path or a dict"):
        lmforge.Trainer(config=42)
    assert not (tmp_path / "a").exists() or not (tmp_path / "a" / "checkpoints").exists()


class _Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, ids):
        return ids.float() * self.w  # (B, T): no vocabulary axis


def test_readme_example_runs(tmp_path, monkeypatch):
    """The Python API example in docs/python-api.md, run as a user would paste it."""
    readme = (REPO / "docs" / "python-api.md").read_text()
    block = re.search(r"<!-- sdk-example -->\s*```python\n(.*?)```", readme, re.S)
    assert block, "docs/python-api.md lost its Python API example"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(textwrap.dedent(block.group(1)), "docs/python-api.md", "exec"), namespace)
    metrics = namespace["metrics"]
    assert metrics["step"] == namespace["trainer"].step > 0 and metrics["loss"] < 5.0  # ln(256) = 5.55
    assert (tmp_path / "runs" / "sdk-demo" / "metrics.jsonl").is_file()


def test_yaml_path_config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        f"run:\n  dir: {tmp_path / 'run'}\ntrain:\n  max_steps: 2\n  seq_len: 32\n  micro_batch_size: 4\n"
        "logging:\n  progress: none\n"
    )
    trainer = lmforge.Trainer(path, model=GRULM(256), train_data=byte_docs())
    assert trainer.cfg.run.dir == load_config(path).run.dir == str(tmp_path / "run")
    assert trainer.fit()["step"] == 2
