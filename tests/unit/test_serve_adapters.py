"""Multi-LoRA serving without HTTP (serve/adapters.py): rows of the base, a LoRA and a DoRA adapter in
one batch give the logits and greedy replies of each merged model alone, the base's bit for bit;
adapters that do not fit the base, too large ranks, base weights in the file, paths outside the root
and too many adapters are refused; unloading lets running requests finish with the adapter."""

from __future__ import annotations

import copy
import gc
import json
import os
from pathlib import Path

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.eval.generate import generate
from lmforge.finetune.lora import apply_lora, merge_lora
from lmforge.finetune.peft_io import CONFIG, WEIGHTS, save_peft_adapter
from lmforge.models import Transformer
from lmforge.serve.adapters import AdapterSet, parse_lora_specs
from lmforge.serve.engine import Engine, SamplingParams


def tiny(**kw) -> Transformer:
    """Random weights, untied head (test_serve_engine's model): greedy replies differ by prompt."""
    torch.manual_seed(0)
    base = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=24,
                tie_embeddings=False, init_std=0.1)
    return Transformer(ModelConfig(**{**base, **kw})).eval()


def text(ids) -> str:
    return "".join(chr(0x100 + t) for t in ids)


class Collect:
    def __init__(self) -> None:
        self.deltas: list[tuple[int, str]] = []

    def __call__(self, ev) -> None:
        assert ev.error is None, ev.error
        self.deltas.append((ev.index, ev.text))

    def text(self, i: int = 0) -> str:
        return "".join(t for j, t in self.deltas if j == i)


def drive(engine: Engine, limit: int = 1000) -> None:
    for _ in range(limit):
        if not engine.step():
            return
    raise AssertionError("the engine did not finish")


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def adapted(base, *, dora: bool, seed: int, targets=("all-linear", "lm_head"), r: int = 4):
    """A copy of `base` with seeded (nonzero) adapters, and the same model with them merged."""
    model = copy.deepcopy(base)
    apply_lora(model, list(targets), r=r, alpha=2.0 * r, dora=dora, init="seeded", seed=seed)
    if dora:  # a trained magnitude, not the one that makes DoRA start equal to LoRA
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("lora_magnitude"):
                    p.mul_(1 + 0.3 * torch.rand(p.shape, generator=torch.Generator().manual_seed(seed)))
    return model, merge_lora(copy.deepcopy(model)).eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    base = tiny()
    root = tmp_path_factory.mktemp("adapters")
    out = {"base": base, "root": root}
    for name, dora, seed, r in (("lo", False, 1, 4), ("do", True, 2, 4), ("lo2", False, 3, 2)):
        model, merged = adapted(base, dora=dora, seed=seed, r=r, targets=("all-linear", "lm_head")
                                if name != "lo2" else ("q_proj", "v_proj", "down_proj"))
        save_peft_adapter(model, root / name, None, base.cfg)
        out[name] = merged
    return out


_OPEN: list[AdapterSet] = []


@pytest.fixture(autouse=True)
def closed():
    """Each test's adapter sets come off the shared base model afterwards."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def open_set(setup, **kw) -> AdapterSet:
    adapters = AdapterSet(setup["base"], "base", root=setup["root"], **kw)
    _OPEN.append(adapters)
    return adapters


def served(setup, **kw) -> AdapterSet:
    adapters = open_set(setup, **kw)
    for name in ("lo", "do", "lo2"):
        adapters.load(name, name)
    return adapters


@pytest.fixture(params=["grouped", "gathered"])
def mode(request, monkeypatch):
    """Rows grouped by adapter, or (from GATHER_FROM adapters in a batch) gathered from stacks."""
    import lmforge.serve.adapters as module

    monkeypatch.setattr(module, "GATHER_FROM", 99 if request.param == "grouped" else 1)
    return request.param


class _Req:
    def __init__(self, adapter):
        self.params = SamplingParams(adapter=adapter)


def test_mixed_batch_logits_equal_each_merged_model(setup, mode):
    base = setup["base"]
    adapters = served(setup)
    engine = Engine(base, text, adapters=adapters)
    ids = torch.randint(0, 61, (6, 9), generator=torch.Generator().manual_seed(3))
    rows = [None, adapters.get("lo"), adapters.get("do"), adapters.get("lo"), None, adapters.get("lo2")]
    with torch.inference_mode():
        got = engine._forward([_Req(a) for a in rows], ids)
        plain = base(ids)
        want_lo, want_do, want_lo2 = setup["lo"](ids), setup["do"](ids), setup["lo2"](ids)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[4], plain[4])  # the base: bit for bit
    for i, want in ((1, want_lo), (2, want_do), (3, want_lo), (5, want_lo2)):
        torch.testing.assert_close(got[i], want[i], rtol=0, atol=1e-5)
        assert (got[i] - plain[i]).abs().max() > 1e-2  # the adapter does change the logits
    with torch.inference_mode():  # every row one adapter: the path without a gather
        torch.testing.assert_close(engine._forward([_Req(rows[2])] * 6, ids), want_do, rtol=0, atol=1e-5)


def test_mixed_batch_greedy_replies_equal_each_merged_model(setup, mode):
    base = setup["base"]
    adapters = served(setup)
    engine = Engine(base, text, max_batch_size=4, adapters=adapters)
    prompts = [[1, 2, 3], [7, 5], [11, 3, 9, 4], [20], [33, 2, 8], [5, 6]]
    which = [None, "lo", "do", "lo2", "do", "lo"]
    models = {None: base, "lo": setup["lo"], "do": setup["do"], "lo2": setup["lo2"]}
    collects = []
    for p, name in zip(prompts, which):
        c = Collect()
        engine.submit([p], SamplingParams(max_tokens=8, temperature=0, adapter=adapters.get(name)), c)
        collects.append(c)
    drive(engine)
    assert engine.peak_batch == 4  # the adapters did decode together
    for p, name, c in zip(prompts, which, collects):
        want = generate(models[name], p, 8, temperature=0.0)[0]
        assert c.text() == text(want), name
    assert len({c.text() for c in collects}) > 2


def test_base_rows_are_bit_for_bit_the_server_without_adapters(setup, mode):
    base = setup["base"]
    prompts = [[1, 2, 3], [7, 5, 6, 1]]
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=5)
    plain = Engine(base, text, max_batch_size=4)
    with_adapters = Engine(base, text, max_batch_size=4, adapters=served(setup))
    outs = []
    for engine in (plain, with_adapters):
        c = Collect()
        engine.submit(prompts, params, c)
        if engine is with_adapters:  # an adapter row in the same batch changes nothing for the base rows
            for name in ("lo", "do", "lo2"):
                lora = SamplingParams(max_tokens=6, adapter=engine.adapters.get(name))
                engine.submit([[4, 4]], lora, Collect())
        drive(engine)
        outs.append([c.text(0), c.text(1)])
    assert outs[0] == outs[1]
    with torch.inference_mode():  # and the logits themselves
        ids = torch.tensor([prompts[1]])
        assert torch.equal(with_adapters._forward([_Req(None)], ids), base(ids))


def test_unload_lets_running_requests_finish_and_frees_the_slot(setup):
    adapters = served(setup, max_adapters=3)
    engine = Engine(setup["base"], text, adapters=adapters)
    c = Collect()
    engine.submit([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0, adapter=adapters.get("lo")), c)
    engine.step()
    adapters.unload("lo")
    assert adapters.get("lo") is None and adapters.names() == ["do", "lo2"]
    with pytest.raises(LmforgeError, match="3 adapters are held"):  # "lo" is still in use
        adapters.load("again", "lo")
    drive(engine)
    assert c.text() == text(generate(setup["lo"], [1, 2, 3], 6, temperature=0.0)[0])
    gc.collect()
    adapters.load("again", "lo")  # the running request ended: its adapter's memory is free
    adapters.unload("again")
    adapters.unload("do")
    adapters.unload("lo2")
    assert not adapters._hooks  # nothing loaded: the base model has no hooks left
    with pytest.raises(KeyError):
        adapters.unload("do")


def test_refusals(setup, tmp_path):
    base = setup["base"]
    # another base's adapter: refused by the tensor's name and shape
    other, _ = adapted(tiny(d_model=48), dora=False, seed=1)
    save_peft_adapter(other, setup["root"] / "other", None, other.cfg)
    # a rank over --max-lora-rank
    big, _ = adapted(base, dora=False, seed=1, r=8)
    save_peft_adapter(big, setup["root"] / "big", None, base.cfg)
    adapters = open_set(setup, max_rank=4)
    adapters.load("lo", "lo")
    with pytest.raises(LmforgeError, match="already loaded"):
        adapters.load("lo", "do")
    with pytest.raises(LmforgeError, match="base model's name"):
        adapters.load("base", "do")
    with pytest.raises(LmforgeError, match="lora_name"):
        adapters.load("../x", "do")
    with pytest.raises(LmforgeError, match=r"has shape .*model needs"):
        adapters.load("other", "other")
    with pytest.raises(LmforgeError, match="exceeds --max-lora-rank 4"):
        adapters.load("big", "big")
    # a base weight saved beside the adapter
    from safetensors.torch import load_file, save_file

    dst = setup["root"] / "withbase"
    dst.mkdir()
    (dst / CONFIG).write_text((setup["root"] / "lo" / CONFIG).read_text())
    tensors = load_file(setup["root"] / "lo" / WEIGHTS)
    tensors["base_model.model.model.embed_tokens.weight"] = base.tok_embeddings.weight.detach().clone()
    save_file(tensors, dst / WEIGHTS, metadata={"format": "pt"})
    with pytest.raises(LmforgeError, match="base weight saved beside"):
        adapters.load("wb", "withbase")
    with pytest.raises(LmforgeError, match="no such adapter dir"):
        adapters.load("none", "missing")
    full = open_set(setup, max_adapters=1)
    full.load("a", "lo")
    with pytest.raises(LmforgeError, match="1 adapters are held"):
        full.load("b", "do")
    assert adapters.names() == ["lo"] and full.names() == ["a"]  # the refused loads left nothing behind


def test_paths_stay_under_the_root(setup, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    (outside / "lo").mkdir(parents=True)
    for f in (CONFIG, WEIGHTS):
        (outside / "lo" / f).write_bytes((setup["root"] / "lo" / f).read_bytes())
    adapters = AdapterSet(setup["base"], "base", root=root)
    _OPEN.append(adapters)
    for bad in ("../outside/lo", str(outside / "lo"), "/etc"):
        with pytest.raises(LmforgeError, match="outside the adapter root"):
            adapters.load("x", bad)
    os.symlink(outside / "lo", root / "link")  # a symlinked dir that leads out
    with pytest.raises(LmforgeError, match="outside the adapter root"):
        adapters.load("x", "link")
    (root / "mixed").mkdir()  # a real dir whose weights file links out
    (root / "mixed" / CONFIG).write_text((outside / "lo" / CONFIG).read_text())
    os.symlink(outside / "lo" / WEIGHTS, root / "mixed" / WEIGHTS)
    with pytest.raises(LmforgeError, match="links outside the adapter root"):
        adapters.load("x", "mixed")
    assert adapters.names() == []
    with pytest.raises(LmforgeError, match="--adapter-root"):
        AdapterSet(setup["base"], "base").load("x", "lo")
    adapters.load("fine", _copy(outside / "lo", root / "ok"))
    assert adapters.names() == ["fine"]
    json.dumps(adapters.cards())


def _copy(src: Path, dst: Path) -> str:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst.name


def test_parse_lora_specs():
    assert parse_lora_specs(["a=runs/x", "b=/p=q"]) == [("a", "runs/x"), ("b", "/p=q")]
    for bad in (["a"], ["=x"], ["a="], ["a=x", "a=y"]):
        with pytest.raises(LmforgeError, match="--lora"):
            parse_lora_specs(bad)


def test_publisher_sends_the_key_only_to_the_configured_servers():
    from lmforge.jobserver.jobs import RequestError
    from lmforge.jobserver.publish import Publisher, normalize_url

    assert normalize_url("http://Host:8000/v1/") == normalize_url("http://host:8000") == "http://host:8000"
    for bad in ("ftp://h", "http://user:pw@h:1", "h:8000", "http://h/?x=1"):
        with pytest.raises(LmforgeError, match="--publish-url"):
            normalize_url(bad)
    with pytest.raises(LmforgeError, match="admin key"):
        Publisher(["http://h:1"], None)
    pub = Publisher(["http://127.0.0.1:8000/v1"], "admin")
    assert pub.parse(b'{"server_url": "http://127.0.0.1:8000", "lora_name": "a"}').server_url == \
        "http://127.0.0.1:8000"
    for body, param in ((b'{"server_url": "http://127.0.0.1:8001/v1", "lora_name": "a"}', "server_url"),
                        (b'{"server_url": "http://127.0.0.1:8000", "lora_name": "a", "x": 1}', "x"),
                        (b'{"lora_name": "a"}', "server_url")):
        with pytest.raises(RequestError) as e:
            pub.parse(body)
        assert e.value.status == 400 and e.value.param == param
