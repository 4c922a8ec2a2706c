"""The one-step engine every training method shares, below the Trainer and the parallel layouts:

    objectives/     what a step minimises (causal LM; SFT, preference, RL, distillation, MLM plug in here)
    step.py         train_step / apply_update: accumulation, loss normalisation, clipping, hooks
    evaluate.py     evaluate_loss: held-out loss, perplexity, bits per byte (Trainer and `lmforge eval`)
    precision.py    autocast dtype and the fp16 loss scaler
    comm.py         the collectives a step needs (identity for one process; lmforge.parallel supplies more)
    loss.py         token cross-entropy; chunked_loss.py: the fused projection + cross-entropy
"""
