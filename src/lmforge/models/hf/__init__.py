"""Hugging Face interoperability: import and export Llama, Mistral, Qwen2, Qwen3, Granite, SmolLM3, OLMo 2,
Gemma 2 / 3, Phi-3 / 4 and GPT-2 checkpoints, the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
DeepSeek-V3 and gpt-oss, and BERT and RoBERTa masked-LM encoders (`bert.py`, built as models/encoder.py's
Encoder and written as ...ForMaskedLM). One module per family; `convert.py` is family-independent.

`from_hf(dir)` builds our Transformer from a transformers model directory (config.json +
safetensors); `to_hf(model, dir)` writes one that `AutoModelForCausalLM.from_pretrained` loads;
`load_pretrained(dir, model)` fills an existing model (for `model.init_from`). `transformers` itself
is never imported: the adapters read config.json and safetensors only.
"""

from lmforge.models.hf.convert import (
    from_hf,
    hf_to_model_config,
    load_pretrained,
    model_config_to_hf,
    read_hf_config,
    to_hf,
)

__all__ = [
    "from_hf", "hf_to_model_config", "load_pretrained", "model_config_to_hf", "read_hf_config", "to_hf",
]
