"""train.activation_offload (engine/act_offload.py): the real save_on_cpu path runs on a CPU when called
directly (a CPU run refuses the key: its activations are in host memory already) and gives the same
gradients bit for bit, with and without activation checkpointing, which leaves fewer tensors to move."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, tiny_overrides
from lmforge.cli import main
from lmforge.config.schema import ModelConfig
from lmforge.engine import act_offload
from lmforge.engine.precision import Precision
from lmforge.engine.step import train_step
from lmforge.models.transformer import Transformer
from lmforge.parallel.checkpointing import apply_activation_checkpointing


class Counting(torch.autograd.graph.save_on_cpu):
    packed = 0

    def __init__(self, pin_memory: bool = False) -> None:
        super().__init__(pin_memory=pin_memory)
        inner = self.pack_hook

        def pack(t):
            Counting.packed += 1
            return inner(t)

        self.pack_hook = pack


def gradients(offload: bool, checkpointing: str) -> tuple[dict, float, int]:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(d_model=64, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=32))
    apply_activation_checkpointing(model, checkpointing)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # the step clears the gradients: compare the update
    batch = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    Counting.packed = 0
    pair = (batch[:, :-1], batch[:, 1:])
    result = train_step(model, [pair], opt, Precision("fp32", torch.device("cpu"), offload))
    return {n: p.detach().clone() for n, p in model.named_parameters()}, result.loss, Counting.packed


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_offloaded_saves_give_the_same_update(monkeypatch, checkpointing):
    monkeypatch.setattr(act_offload.torch.autograd.graph, "save_on_cpu", Counting)
    plain, loss, none_packed = gradients(False, checkpointing)
    offloaded, loss2, packed = gradients(True, checkpointing)
    assert none_packed == 0 and packed > 0  # the offload path really ran
    assert loss == loss2 and plain.keys() == offloaded.keys()
    assert all(torch.equal(plain[k], offloaded[k]) for k in plain)


def test_checkpointing_leaves_fewer_tensors_to_offload(monkeypatch):
    monkeypatch.setattr(act_offload.torch.autograd.graph, "save_on_cpu", Counting)
    _, _, all_saved = gradients(True, "none")
    _, _, boundaries = gradients(True, "full")
    assert 0 < boundaries < all_saved / 2


def test_refused_on_a_cpu_before_any_work(tmp_path, shared_data_dir, capsys):
    run = tmp_path / "run"
    overrides = tiny_overrides(run, shared_data_dir, "train.activation_offload=true")
    sets = sum((["--set", o] for o in overrides), [])
    assert main(["train", "-c", str(TINY), *sets]) == 2
    assert "train.activation_offload=true moves saved activations" in capsys.readouterr().err
    assert not run.exists()
