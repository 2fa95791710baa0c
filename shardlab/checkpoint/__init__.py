"""Checkpoints: the on-disk format (format.py), writing (save.py, async_save.py), reading
(reader.py), a rank's pieces of the model and optimizer state (pieces.py) and whole tensors from
all ranks' pieces (reshard.py); docs/checkpoints.md. The Hugging Face and GGUF adapters, which
know the architectures, stay in models/ (hf.py, pretrained.py) and use this package."""
