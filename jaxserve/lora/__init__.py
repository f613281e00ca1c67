"""LoRA adapters served over one base model: the request type, PEFT loading (host side, no jax)."""

from jaxserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
