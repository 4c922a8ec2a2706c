"""Compression of trained models: weight-only quantization (round-to-nearest and GPTQ) and pruning
(magnitude, 2:4, whole heads / MLP channels) with a recovery fine-tune. Distillation is an objective
(lmforge.engine.objectives.distill); the quantized linear layer itself lives in lmforge.models.quant so
that any run dir holding a quantized model loads like another."""
