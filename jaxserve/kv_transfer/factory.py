"""The registry of KV connectors by name (`--kv-transfer-config '{"kv_connector": NAME, ...}'`).

A connector is a module with `make_connector(config, *, page_size, **options)` returning its
scheduler half and its worker half (`kv_transfer.base`); it is imported only when an engine asks
for it, so registering one costs nothing. Unknown names are a
ConfigError listing the known ones.
"""

from __future__ import annotations

import importlib
from typing import Any

from jaxserve.errors import ConfigError
from jaxserve.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker, KVTransferConfig

_REGISTRY: dict[str, str] = {}  # name -> module

# vLLM's name for the connector its --kv-offloading-size builds; jaxserve's host tier answers to it.
OFFLOADING_CONNECTOR = "OffloadingConnector"


def register_connector(name: str, module: str) -> None:
    """Make `name` usable in kv_transfer_config (`module` is imported on first use)."""
    _REGISTRY[name] = module


def known_connectors() -> list[str]:
    return sorted(_REGISTRY)


def check_connector(config: KVTransferConfig) -> None:
    """ConfigError unless `config.kv_connector` is registered."""
    if config.kv_connector not in _REGISTRY:
        raise ConfigError(
            f"kv_transfer_config: unknown kv_connector {config.kv_connector!r}; known: {known_connectors()}"
        )


def create_connector(
    config: KVTransferConfig, *, page_size: int, **options: Any
) -> tuple[KVConnectorScheduler, KVConnectorWorker]:
    """Both halves of the named connector. `options` are the engine's facts the connector may need
    (the host tier: `capacity_bytes`, `page_bytes`)."""
    check_connector(config)
    return importlib.import_module(_REGISTRY[config.kv_connector]).make_connector(
        config, page_size=page_size, **options
    )


register_connector(OFFLOADING_CONNECTOR, "jaxserve.kv_transfer.host_tier")
# Prefill and decode on separate engines (docs/disaggregation.md).
register_connector("JaxTransferConnector", "jaxserve.disagg.connector")
