"""`lmforge estimate` on hostile input: counts and sizes past what it walks (it hung on a huge model),
methods it does not model (refused by name, never answered with pretraining numbers), a tokenizer path
that is a FIFO or a device, a device size of infinity; and a fine-tuning config that must answer."""

from __future__ import annotations

from caselib import Case, common, fifo

E = lambda *extra: lambda ws: ["estimate", *common(ws), "--device-memory", "64", *extra]  # noqa: E731


def S(*pairs: str) -> list[str]:  # noqa: N802 - reads like caselib's S
    return [x for p in pairs for x in ("--set", p)]


CASES: list[Case] = [
    # -- sizes: bounded before work starts, or arithmetic whatever their size ------------------------
    Case("estimate a hundred million blocks", E(*S("model.n_layers=100000000")), match="model.n_layers",
         subprocess=True),
    Case("estimate a billion pipeline micro-batches",
         E("--world-size", "2",
           *S("parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_microbatches=1000000000")),
         match="parallel.pp_microbatches", subprocess=True),
    Case("estimate ZeRO-1 on a trillion ranks", E("--world-size", "1000000000000", *S("parallel.zero=1")),
         match="--world-size", subprocess=True),
    Case("estimate a hundred million experts, selective checkpointing",
         E(*S("model.moe.n_experts=100000000", "train.activation_checkpointing=selective",
              "train.ac_save=alternate_matmuls")), expect=1, subprocess=True),
    Case("estimate a model wider than any device",
         E(*S("model.d_model=1048576", "model.n_heads=4096", "model.max_seq_len=1000000000",
              "train.micro_batch_size=1000000000")), expect=1, subprocess=True),
    Case("estimate a vocabulary past int64", E(*S(f"model.vocab_size={10**30}")), match="model.vocab_size"),
    Case("estimate experts past torch's sizes",
         E(*S(f"model.moe.n_experts={1 << 31}", f"model.moe.d_ff_expert={1 << 31}")),
         match="torch cannot hold"),
    Case("estimate against infinite device memory",
         lambda ws: ["estimate", *common(ws), "--device-memory", "inf"], match="--device-memory"),
    Case("estimate reads the tokenizer from a FIFO",
         E(*S("data.dir={ws}/nodata", "data.tokenizer.path={ws}/pipe")), fifo("pipe"),
         match="not a regular file", subprocess=True),
    Case("estimate reads the tokenizer from /dev/zero",
         E(*S("data.dir={ws}/nodata", "data.tokenizer.path=/dev/zero")), match="not a regular file",
         subprocess=True),
    # -- methods it does not model: refused by name ----------------------------------------------
    Case("estimate objective rl", E(*S("objective.name=rl")), match="objective rl"),
    Case("estimate objective distill", E(*S("objective.name=distill")), match="objective distill"),
    Case("estimate DoRA", E(*S("objective.name=sft", "finetune.method=dora")), match="finetune.method=dora"),
    Case("estimate LoRA under FSDP", E("--world-size", "2", *S("finetune.method=lora")),
         match="finetune.method=lora"),
    Case("estimate full DPO under FSDP", E("--world-size", "2", *S("objective.name=dpo")),
         match="frozen copy of the model as its reference"),
    # -- a fine-tuning config answers, with the architecture of the run it starts from ------------
    Case("estimate QLoRA SFT from the run", E(*S("objective.name=sft", "finetune.method=qlora",
                                                 "model.init_from={ws}/run")), expect=0),
]
