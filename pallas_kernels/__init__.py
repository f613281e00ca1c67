"""Pallas kernels of jaxserve (standalone): ragged paged attention, int8 and int4 matmul."""

# Every kernel takes `backend` ("tpu": Mosaic, "gpu": Triton, None: from
# jax.default_backend()) and `interpret` (run on CPU in the Pallas interpreter),
# and has a plain-JAX `reference_*` twin with the same signature.

from pallas_kernels.int4_matmul import int4_matmul, reference_int4_matmul
from pallas_kernels.int8_matmul import int8_matmul, reference_int8_matmul
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, reference_ragged_paged_attention

__all__ = [
    "int4_matmul",
    "int8_matmul",
    "ragged_paged_attention",
    "reference_int4_matmul",
    "reference_int8_matmul",
    "reference_ragged_paged_attention",
]
