"""A request's sampling: its parameters (`params.SamplingParams`) and the table of sampling fields
(`fields`) that the API, generation_config.json and the device sampler all read. Host only; the
device sampler is `jaxserve.model.sampler`."""
