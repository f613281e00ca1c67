"""The device half of the engine: the runner (executables, `execute`), the persistent input batch,
compilation, the speculative step, grammar masks and the multi-host broadcast."""
