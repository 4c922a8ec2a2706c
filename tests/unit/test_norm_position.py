"""model.norm_placement as a general switch: Pre-LN and Post-LN for the decoder and for the encoder.

Each block is checked against the textbook formula written out here from the block's own weights
(Pre-LN x + f(norm(x)); Post-LN norm(x + f(x))), so a placement that silently fell back to another
one fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from lmforge.checkpoint.manager import check_shapes, param_shapes
from lmforge.config import ModelConfig
from lmforge.errors import CheckpointMismatchError, LmforgeError
from lmforge.models import build_model
from lmforge.models.hf import model_config_to_hf

SMALL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
ENCODER = dict(arch="encoder", norm="layernorm", mlp="gelu", pos_embedding="learned", bias=True,
               tie_embeddings=True)


def _model(**kw) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(ModelConfig(**SMALL, **kw)).eval()
    with torch.no_grad():  # norms away from their identity init, so that where they sit matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _x() -> torch.Tensor:
    return torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1))


def test_unset_placement_is_each_familys_own():
    assert ModelConfig(**SMALL).norm_placement == "pre"
    assert ModelConfig(**SMALL, **ENCODER).norm_placement == "post_ln"


@pytest.mark.parametrize("placement", ["post", "sandwich"])
def test_encoder_refuses_the_decoders_other_placements(placement):
    with pytest.raises(ValidationError, match="norm_placement"):
        ModelConfig(**SMALL, **ENCODER, norm_placement=placement)


@pytest.mark.parametrize("placement", ["pre", "post_ln"])
def test_encoder_block_is_the_textbook_formula(placement):
    model = _model(**ENCODER, norm_placement=placement)
    block, x = model.layers[0], _x()
    attn = lambda h: block.attn(h, None, None)  # noqa: E731
    with torch.no_grad():
        if placement == "pre":
            h = x + attn(block.attn_norm(x))
            want = h + block.mlp(block.mlp_norm(h))
        else:
            h = block.attn_norm(x + attn(x))
            want = block.mlp_norm(h + block.mlp(h))
        torch.testing.assert_close(block(x), want, rtol=0, atol=0)
    assert hasattr(model, "final_norm") == (placement == "pre")


def test_pre_ln_encoder_ends_in_its_final_norm():
    model = _model(**ENCODER, norm_placement="pre")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    seen = []
    model.final_norm.register_forward_hook(lambda m, i, o: seen.append((i[0], o)))
    with torch.no_grad():
        model(ids)
    (inp, out), = seen
    torch.testing.assert_close(out, model.final_norm(inp), rtol=0, atol=0)


def test_decoder_post_ln_block_is_the_textbook_formula():
    model = _model(norm_placement="post_ln")
    block, x = model.layers[0], _x()
    rope = (model.rope_cos[:12], model.rope_sin[:12])
    with torch.no_grad():
        h = block.attn_norm(x + block.attn(x, rope, None, None))
        want = block.mlp_norm(h + block.mlp(h))
        torch.testing.assert_close(block(x, rope), want, rtol=0, atol=0)
        pre = _model(norm_placement="pre")
        pre.load_state_dict(model.state_dict())  # the same parameters: only the placement differs
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
        assert not torch.allclose(pre(ids), model(ids))


def test_post_ln_has_no_hugging_face_layout():
    with pytest.raises(LmforgeError, match="norm_placement"):
        model_config_to_hf(ModelConfig(**SMALL, norm_placement="post_ln"))
    with pytest.raises(LmforgeError, match="norm_placement=pre"):
        model_config_to_hf(ModelConfig(**SMALL, **ENCODER, norm_placement="pre"))
    assert model_config_to_hf(ModelConfig(**SMALL, **ENCODER))["model_type"] == "bert"


def test_an_old_post_ln_encoder_checkpoint_under_pre_says_what_to_set():
    """Configs written before the switch reached encoders say pre for BERT's blocks."""
    saved = {"param_shapes": param_shapes(_model(**ENCODER, norm_placement="post_ln"))}
    with pytest.raises(CheckpointMismatchError, match="norm_placement: post_ln"):
        check_shapes(Path("ckpt"), saved, _model(**ENCODER, norm_placement="pre"))


def test_t5_is_pre_ln_and_refuses_another_placement():
    t5 = dict(arch="t5", pos_embedding="relative", mlp="relu", n_layers=2, vocab_size=64, d_model=32,
              n_heads=4, max_seq_len=16)
    assert ModelConfig(**t5).norm_placement == "pre"
    with pytest.raises(ValidationError, match="norm_placement='post_ln'"):
        ModelConfig(**t5, norm_placement="post_ln")
