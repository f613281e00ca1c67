"""KV connectors: KV pages that enter and leave an engine's device pool (host only, no jax).

`base` is the interface (vLLM V1's KVConnector split into a scheduler half and a worker half),
`factory` the registry of connectors by name, `host_tier` the host-memory tier of the prefix cache
(`--kv-offloading-size`), `disagg` the scheduler half of `JaxTransferConnector` (prefill and decode on
separate engines; its worker and transport are `jaxserve.disagg`, device side). The device half that
moves pages is `jaxserve.runner.page_io`.
"""
