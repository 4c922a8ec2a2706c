"""Fine-tuning on top of a trained model: LoRA / DoRA adapters (`lora`), their Hugging Face PEFT
file format (`peft_io`) and 4-bit NF4 base weights for QLoRA (`nf4`)."""
