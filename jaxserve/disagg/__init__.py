"""Prefill and decode on separate engines, the device side: the transport (`transport`), the
`JaxTransferConnector`'s worker half (`connector`) and the P/D proxy (`proxy`). The scheduler half
is host only: `jaxserve.kv_transfer.disagg`."""
