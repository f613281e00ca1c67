"""Turning what a user names as a model (a directory, a GGUF file, a Hugging Face ID, nothing) into
files the engine reads: checkpoints, configs, tokenizers, hub resolution. Host-only: no jax here."""
