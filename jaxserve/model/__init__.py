"""Llama-family model: params pytree, layers, and the pure forward function."""
