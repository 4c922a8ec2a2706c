"""A trained run out of lmforge (any run: pretrained, fine-tuned, aligned): `lmforge export` as a Hugging
Face model dir or a PEFT adapter dir, `lmforge merge` (hf.py); `lmforge export --format gguf` for llama.cpp
and Ollama (gguf.py; gguf_arch/: one module per family; gguf_vocab.py: the tokenizer; kquants.py: the
Q4_K / Q6_K blocks; ollama.py: the Modelfile). Until this release these lived in lmforge.finetune, whose
old paths stay importable for one release."""
