"""Objectives: the causal-LM loss (plain and chunked), one compiled graph with the model, and a new
objective plugging into the unchanged step and evaluation (per-target normalisation, metrics)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from lmforge.config import ModelConfig
from lmforge.data.batch import IGNORE_INDEX, TokenBatch
from lmforge.engine.evaluate import evaluate_loss
from lmforge.engine.objectives import CausalLM, Objective, ObjectiveModule, ObjectiveOutput
from lmforge.engine.precision import Precision
from lmforge.engine.step import train_step
from lmforge.models import build_model

CPU = torch.device("cpu")
FP32 = Precision("fp32", CPU)


def model(tie: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(ModelConfig(preset="debug", vocab_size=160, max_seq_len=32, tie_embeddings=tie))


def batch(rows: int = 4, t: int = 24, seed: int = 1) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 160, (rows, t), generator=g)
    y = torch.randint(0, 160, (rows, t), generator=g)
    y[0, :7] = IGNORE_INDEX
    y[2, 5:] = IGNORE_INDEX
    return TokenBatch(x, y)


def grads(m) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("chunk", [1, 17, 1000])
def test_chunked_causal_lm_equals_the_plain_loss(tie, chunk):
    """Same summed loss within 1e-6 relative in fp32, same gradients for every parameter (the head's
    included, tied or not); chunk sizes that do not divide the 96 tokens, and one larger than them."""
    a, b = model(tie), model(tie)
    bt = batch()
    plain = CausalLM()(a, bt).loss
    chunked = CausalLM(chunk_tokens=chunk)(b, bt).loss
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)
    reference = F.cross_entropy(a(bt.input_ids).view(-1, 160), bt.targets.view(-1), reduction="sum")
    assert plain.item() == pytest.approx(reference.item(), rel=1e-7)
    plain.backward()
    chunked.backward()
    ga, gb = grads(a), grads(b)
    for n in ga:
        scale = ga[n].abs().max().item()
        # atol relative to the tensor's largest entry: entries that cancel to ~0 move by a few fp32 ulps
        # of that scale when chunking changes the matmuls' summation order.
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-5, atol=1e-6 * scale, msg=n)


def test_chunked_loss_through_train_step_and_evaluation():
    a, b = model(), model()
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.5), torch.optim.SGD(b.parameters(), lr=0.5)
    batches = [batch(seed=s) for s in (1, 2)]
    ra = train_step(a, batches, oa, FP32, objective=CausalLM())
    rb = train_step(b, batches, ob, FP32, objective=CausalLM(chunk_tokens=32))
    assert rb.loss == pytest.approx(ra.loss, rel=1e-6) and rb.target_tokens == ra.target_tokens
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    ea = evaluate_loss(a, batches, CausalLM(), precision=FP32)
    eb = evaluate_loss(a, batches, CausalLM(chunk_tokens=32), precision=FP32)
    assert eb["loss"] == pytest.approx(ea["loss"], rel=1e-6) and eb["tokens"] == ea["tokens"]


def test_the_objective_compiles_into_the_models_graph():
    """torch.compile of model + objective is one graph: no break between the blocks and the loss
    (the loss is not an eager op on a copy of the logits outside it)."""
    m = model()
    explained = torch._dynamo.explain(ObjectiveModule(m, CausalLM()))(batch())
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    ops = [str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("cross_entropy" in op for op in ops)
    chunked = torch._dynamo.explain(ObjectiveModule(m, CausalLM(chunk_tokens=32)))(batch())
    assert chunked.graph_break_count == 0


@pytest.mark.slow
def test_compiled_objective_equals_eager():
    a, b = model(), model()
    bt = batch()
    eager = CausalLM()(a, bt).loss
    compiled = torch.compile(ObjectiveModule(b, CausalLM()))(bt).loss
    assert compiled.item() == pytest.approx(eager.item(), rel=1e-5)
    eager.backward()
    compiled.backward()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)


# -- a new objective is one class: the step, evaluation and normalisation need no change ------------
@dataclass(frozen=True)
class WeightedBatch:
    input_ids: torch.Tensor
    targets: torch.Tensor
    weights: torch.Tensor  # (B, T) per-token weights, as an RL objective would carry advantages

    def to(self, device, non_blocking=False):
        return WeightedBatch(*(t.to(device) for t in (self.input_ids, self.targets, self.weights)))

    device = property(lambda self: self.input_ids.device)
    num_tokens = property(lambda self: self.input_ids.numel())


class WeightedLM(Objective):
    """Per-token weighted cross-entropy with a top-1 accuracy metric."""

    name = "weighted_lm"
    batch_type = WeightedBatch

    def num_targets(self, batch):
        return int((batch.targets != IGNORE_INDEX).sum())

    def __call__(self, model, batch):
        logits = model(batch.input_ids).float()  # (B, T, V)
        per_token = F.cross_entropy(logits.transpose(1, 2), batch.targets, ignore_index=IGNORE_INDEX,
                                    reduction="none")  # (B, T)
        mask = batch.targets != IGNORE_INDEX
        correct = ((logits.argmax(-1) == batch.targets) & mask).sum().float()
        return ObjectiveOutput((per_token * batch.weights).sum(), {"accuracy": correct})


def test_a_new_objective_plugs_into_the_step():
    """Accumulated over two micro-batches, normalised by the step's target count, metrics as means per
    target: the same update as the weighted loss written out by hand on the whole batch."""
    bts = [batch(seed=s) for s in (1, 2)]
    weights = [
        torch.rand(b.targets.shape, generator=torch.Generator().manual_seed(9 + i)) for i, b in enumerate(bts)
    ]
    wb = [WeightedBatch(b.input_ids, b.targets, w) for b, w in zip(bts, weights)]
    a = model()
    ref = copy.deepcopy(a)
    opt = torch.optim.SGD(a.parameters(), lr=1.0)
    r = train_step(a, wb, opt, FP32, objective=WeightedLM())
    n = sum(int((b.targets != IGNORE_INDEX).sum()) for b in bts)
    assert r.target_tokens == n
    x = torch.cat([b.input_ids for b in bts])
    y = torch.cat([b.targets for b in bts])
    w = torch.cat(weights)
    logits = ref(x)
    per_token = F.cross_entropy(logits.transpose(1, 2), y, ignore_index=IGNORE_INDEX, reduction="none")
    loss = (per_token * w).sum() / n
    loss.backward()
    with torch.no_grad():
        accuracy = ((logits.argmax(-1) == y) & (y != IGNORE_INDEX)).sum().item() / n
        for p in ref.parameters():
            p -= p.grad
    assert r.loss == pytest.approx(loss.item(), rel=1e-6)
    assert r.metrics == {"accuracy": pytest.approx(accuracy, rel=1e-6)}
    for (name, p), q in zip(a.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)
    out = evaluate_loss(ref, wb, WeightedLM(), precision=FP32)
    assert set(out) == {"loss", "ppl", "tokens", "accuracy"} and out["tokens"] == n  # no bpb: no target ids


def test_wrong_batch_type_is_refused():
    with pytest.raises(TypeError, match="objective weighted_lm takes WeightedBatch batches, got TokenBatch"):
        train_step(
            model(), [batch()], torch.optim.SGD(model().parameters(), lr=1.0), FP32, objective=WeightedLM()
        )
