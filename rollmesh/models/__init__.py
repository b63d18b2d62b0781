"""Model and tokenizer loading (Hugging Face checkpoints, the random `tiny` model) and sharded loading for FSDP2."""
