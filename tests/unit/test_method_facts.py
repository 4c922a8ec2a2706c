"""Each training method's static facts live in the config union (config/methods.py) and every reader asks
them: the console's val_ppl and `lmforge eval`'s ppl agree (a distill run's console once omitted it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lmforge.config.methods import METHOD_CONFIGS, method_facts, objective_config
from lmforge.config.schema import Config
from lmforge.errors import ConfigError

EXPECTED = {  # name: (data, token_loss, data_section, extra models, scalar head)
    "causal_lm": ("tokens", True, "data", (), None),
    "sft": ("chat", True, "sft", (), None),
    "dpo": ("pairs", False, "preference", ("reference",), None),
    "reward": ("pairs", False, "preference", (), "score"),
    "rl": ("prompts", False, "rl", (), None),
    "distill": ("tokens", True, "data", ("teacher",), None),
    "mlm": ("tokens", False, "data", (), None),
    "gkd": ("chat", True, "sft", ("teacher",), None),
    "classify": ("labelled", False, "classify", (), "score"),
    "prefix_lm": ("tokens", True, "data", (), None),
    "glm": ("tokens", False, "data", (), None),
    "tag": ("tagged", False, "token_classify", (), "score"),
    "qa": ("spans", False, "qa", (), "score"),
    "span_corruption": ("tokens", True, "data", (), None),
    "seq2seq": ("text2text", True, "seq2seq", (), None),
}


ENCODER = {"arch": "encoder", "pos_embedding": "learned", "tie_embeddings": True}


def _cfg(name: str, **kw) -> Config:
    model = ENCODER if name == "mlm" else {"arch": "t5"} if name in ("span_corruption", "seq2seq") else {}
    return Config(objective={"name": name}, model=model, **kw)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_method_declares_its_facts(name):
    f = method_facts(_cfg(name))
    assert (f.data, f.token_loss, f.data_section, f.extra_models, f.scalar_head) == EXPECTED[name]
    assert f.chat == (f.data != "tokens")
    assert set(METHOD_CONFIGS) == set(EXPECTED)


def test_facts_follow_the_methods_settings():
    assert method_facts(_cfg("dpo", preference={"loss": "kto"})).data == "unpaired"
    assert method_facts(_cfg("dpo", preference={"loss": "simpo"})).extra_models == ()
    rl = method_facts(_cfg("rl", rl={"algorithm": "ppo", "group_size": 1, "beta": 0.1}))
    assert rl.scalar_head == "value" and rl.extra_models == ("reference",)


def test_the_section_is_a_union_on_its_name():
    assert type(_cfg("dpo").objective).__name__ == "DPOObjective"
    assert type(Config().objective).__name__ == "CausalLMObjective"
    assert objective_config(name="rl").name == "rl"
    with pytest.raises(ConfigError, match="expected tags: 'causal_lm', 'sft', 'dpo'"):
        from lmforge.config.load import validate_config

        validate_config({"objective": {"name": "ppo"}})


def test_a_copied_section_answers_for_the_name_it_holds():
    # `cfg.objective.model_copy(update={"name": ...})` (a method verb does it) gives that method's class
    cfg = Config()
    cfg = cfg.model_copy(update={"objective": cfg.objective.model_copy(update={"name": "sft"})})
    assert method_facts(cfg).chat and method_facts(cfg).data_section == "sft"
    assert type(cfg.objective).__name__ == "SFTObjective"
    assert type(cfg.objective.model_copy()).__name__ == "SFTObjective"


@pytest.mark.parametrize("name", ["causal_lm", "sft", "distill", "dpo", "rl"])
def test_console_and_eval_agree_on_perplexity(name):
    from lmforge.train.callbacks import MetricsLogging

    lines = []
    trainer = SimpleNamespace(cfg=_cfg(name), console=lines.append)
    cb = MetricsLogging()
    cb.logger = SimpleNamespace(log=lambda m: None)
    cb.trackers = None
    cb.on_evaluate(trainer, {"step": 4, "val_loss": 1.0, "val_ppl": 2.72})
    assert ("val_ppl 2.72" in lines[0]) == EXPECTED[name][1]


def test_each_fine_tuning_method_names_its_verb():
    from lmforge.cli.verbs.method_verbs import METHOD_VERBS
    from lmforge.config.methods import METHOD_CONFIGS

    # causal_lm, mlm, prefix_lm, glm: lmforge train
    assert sorted(METHOD_VERBS) == ["classify", "distill", "dpo", "gkd", "qa", "reward", "rl", "sft",
                                    "tag"]
    for verb, spec in METHOD_VERBS.items():
        assert METHOD_CONFIGS[verb].model_fields["name"].default == verb and spec.help.startswith(
            ("fine-tune", "preference", "train a", "reinforcement", "knowledge"))


def test_a_section_that_names_no_method_leaves_the_name_unset():
    # `lmforge sft -c run.yaml` refuses a config whose objective.name is set to another method; a config
    # with an empty objective section set none
    assert Config(objective={}).objective.model_fields_set == set()
    assert Config(objective={"name": "causal_lm"}).objective.model_fields_set == {"name"}
