"""The serving engine: host-side scheduling and KV-cache page bookkeeping around the compiled model step."""
