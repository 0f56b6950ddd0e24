"""The policy update: packing episodes into micro-batches, the GRPO loss family, the trainer
(FSDP2, mixed precision, AdamW) and its checkpoints."""
