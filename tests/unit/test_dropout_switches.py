"""model.attention_dropout / model.hidden_dropout: where each acts, that unset they are model.dropout
bit for bit, and how they travel to and from Hugging Face config.json files."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from lmforge.config import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.models import build_model
from lmforge.models.hf import hf_to_model_config, model_config_to_hf, to_hf

SMALL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
ENCODER = dict(arch="encoder", norm="layernorm", mlp="gelu", pos_embedding="learned", bias=True,
               tie_embeddings=True)
ARCHS = {"decoder": {}, "encoder": ENCODER}


def _model(arch: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(**SMALL, **ARCHS[arch], **kw))


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


def _train_forward(model: torch.nn.Module, seed: int = 5) -> torch.Tensor:
    model.train()
    torch.manual_seed(seed)
    return model(_ids())


def test_unset_means_model_dropout():
    cfg = ModelConfig(**SMALL, dropout=0.2)
    assert (cfg.attention_dropout, cfg.hidden_dropout) == (None, None)
    assert (cfg.resolved_attention_dropout, cfg.resolved_hidden_dropout) == (0.2, 0.2)
    cfg = ModelConfig(**SMALL, dropout=0.2, attention_dropout=0.0, hidden_dropout=0.3)
    assert (cfg.resolved_attention_dropout, cfg.resolved_hidden_dropout) == (0.0, 0.3)


@pytest.mark.parametrize("key", ["attention_dropout", "hidden_dropout"])
@pytest.mark.parametrize("value", [1.0, -0.1])
def test_out_of_range_is_refused_by_name(key, value):
    with pytest.raises(ValidationError, match=key):
        ModelConfig(**SMALL, **{key: value})


@pytest.mark.parametrize("arch", ARCHS)
def test_unset_switches_give_model_dropouts_outputs_bit_for_bit(arch):
    legacy = _train_forward(_model(arch, dropout=0.2))
    split = _train_forward(_model(arch, dropout=0.2, attention_dropout=0.2, hidden_dropout=0.2))
    assert torch.equal(legacy, split)
    assert torch.equal(_train_forward(_model(arch)), _train_forward(_model(arch, attention_dropout=0.0,
                                                                          hidden_dropout=0.0)))


def _record(model: torch.nn.Module, arch: str):
    """Hooks recording each hidden-dropout site's (input, output) and the first attention's call."""
    drops, attn = [], []
    for name, module in model.named_modules():
        if name.split(".")[-1] == "drop":
            module.register_forward_hook(lambda m, a, out: drops.append((a[0], out)))
    first = model.layers[0].attn
    first.register_forward_hook(lambda m, a, kw, out: attn.append((a, kw, out)), with_kwargs=True)
    return drops, attn


def _attention_redone_in_eval(model: torch.nn.Module, attn: list) -> tuple[torch.Tensor, torch.Tensor]:
    args, kwargs, out = attn[0]
    attention = model.layers[0].attn
    attention.eval()
    with torch.no_grad():
        again = attention(*args, **kwargs)
    return out, again


@pytest.mark.parametrize("arch", ARCHS)
def test_attention_dropout_alone_leaves_the_residual_path_deterministic(arch):
    model = _model(arch, attention_dropout=0.5)
    drops, attn = _record(model, arch)
    _train_forward(model)
    assert drops and all(torch.equal(i, o) for i, o in drops)  # residual branches and embeddings untouched
    out, again = _attention_redone_in_eval(model, attn)
    assert not torch.allclose(out, again)  # the attention probabilities were dropped
    assert not torch.equal(_train_forward(model, seed=5), _train_forward(model, seed=6))


@pytest.mark.parametrize("arch", ARCHS)
def test_hidden_dropout_alone_leaves_attention_deterministic(arch):
    model = _model(arch, hidden_dropout=0.5)
    drops, attn = _record(model, arch)
    _train_forward(model)
    assert drops and all(not torch.equal(i, o) for i, o in drops)  # every site drops
    out, again = _attention_redone_in_eval(model, attn)
    torch.testing.assert_close(out, again)  # the attention itself drew no mask


def test_softcapped_attention_takes_attention_dropout():
    # the explicit attention path (soft-capped scores), not SDPA's dropout_p
    model = _model("decoder", attention_dropout=0.5, attn_logit_softcap=30.0)
    drops, attn = _record(model, "decoder")
    _train_forward(model)
    assert all(torch.equal(i, o) for i, o in drops)
    out, again = _attention_redone_in_eval(model, attn)
    assert not torch.allclose(out, again)


@pytest.mark.parametrize("arch", ARCHS)
def test_eval_mode_is_deterministic(arch):
    model = _model(arch, attention_dropout=0.3, hidden_dropout=0.4).eval()
    plain = _model(arch).eval()
    with torch.no_grad():
        a, b, c = model(_ids()), model(_ids()), plain(_ids())
    assert torch.equal(a, b) and torch.equal(a, c)


# ------------------------------------------------------------------ Hugging Face config.json

BERT = dict(SMALL, **ENCODER)
GPT2 = dict(SMALL, norm="layernorm", mlp="gelu", pos_embedding="learned", bias=True, tie_embeddings=True)
LLAMA = dict(SMALL)


@pytest.mark.parametrize("base, fields", [
    (BERT, {"attention_probs_dropout_prob": 0.25, "hidden_dropout_prob": 0.1}),
    (GPT2, {"attn_pdrop": 0.25, "resid_pdrop": 0.1, "embd_pdrop": 0.1}),
])
def test_split_dropouts_export_and_import(base, fields):
    cfg = ModelConfig(**base, attention_dropout=0.25, hidden_dropout=0.1)
    hf = model_config_to_hf(cfg)
    assert {k: hf[k] for k in fields} == fields
    back = hf_to_model_config(hf)
    assert (back.resolved_attention_dropout, back.resolved_hidden_dropout) == (0.25, 0.1)
    legacy = model_config_to_hf(ModelConfig(**base, dropout=0.1))  # model.dropout alone: every field
    assert {legacy[k] for k in fields} == {0.1}
    back = hf_to_model_config(legacy)
    assert (back.dropout, back.attention_dropout, back.hidden_dropout) == (0.1, None, None)


def test_llama_attention_dropout_exports_and_imports():
    hf = model_config_to_hf(ModelConfig(**LLAMA, attention_dropout=0.25))
    assert hf["attention_dropout"] == 0.25
    back = hf_to_model_config(hf)
    assert (back.resolved_attention_dropout, back.resolved_hidden_dropout) == (0.25, 0.0)
    assert hf_to_model_config(model_config_to_hf(ModelConfig(**LLAMA))).attention_dropout is None


def test_gpt2_differing_residual_and_embedding_dropout_is_refused():
    hf = model_config_to_hf(ModelConfig(**GPT2))
    with pytest.raises(LmforgeError, match="resid_pdrop/embd_pdrop"):
        hf_to_model_config({**hf, "resid_pdrop": 0.1, "embd_pdrop": 0.2})


@pytest.mark.parametrize("kw, needle", [
    (dict(LLAMA, hidden_dropout=0.1), "model.hidden_dropout=0.1 .no residual/embedding dropout field"),
    (dict(LLAMA, hf_model_type="phi3", attention_dropout=0.1), "model.attention_dropout=0.1"),
])
def test_export_refuses_a_dropout_the_family_cannot_write(tmp_path, kw, needle):
    torch.manual_seed(0)
    model = build_model(ModelConfig(**kw))
    out = tmp_path / "hf"
    with pytest.raises(LmforgeError, match=needle):
        to_hf(model, out)
    assert not out.exists()  # refused before anything is written


def test_a_set_zero_needs_no_field():
    # hidden_dropout=0.0 is what a family without the field means: exported, not refused
    from lmforge.models.hf.dropout import check_dropouts

    cfg = ModelConfig(**LLAMA, dropout=0.1, hidden_dropout=0.0)
    check_dropouts(cfg, model_config_to_hf(cfg), "llama")


def test_a_run_may_choose_its_own_dropouts_over_imported_weights(tmp_path):
    # dropout is the run's choice, not the architecture's: load_pretrained does not compare it
    from lmforge.models.hf import load_pretrained

    torch.manual_seed(0)
    to_hf(build_model(ModelConfig(**LLAMA, attention_dropout=0.1)), tmp_path)
    model = build_model(ModelConfig(**LLAMA, attention_dropout=0.3, hidden_dropout=0.2))
    load_pretrained(tmp_path, model)
    assert model.layers[0].attn.dropout == 0.3
