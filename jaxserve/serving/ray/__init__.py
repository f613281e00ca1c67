"""jaxserve replicas on Ray Serve (`jaxserve serve-ray`, docs/scale-out.md): an engine deployment whose
replicas each hold one AsyncLLMEngine, an OpenAI ingress in front, and a prefix-aware request router
on the handle between them. Needs the `[ray]` extra; nothing outside this package imports ray."""
