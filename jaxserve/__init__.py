"""jaxserve: an LLM inference engine in JAX (paged KV cache, continuous batching, Pallas kernels, sharding)."""
