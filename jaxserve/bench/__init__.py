"""`jaxserve bench`: benchmarks a user runs from the installed package, in the shape of `vllm bench`.

    jaxserve bench serve       a streamed load against any OpenAI-compatible server (jaxserve, vLLM,
                               llama-server): throughput, TTFT / TPOT / ITL percentiles, goodput, a JSON result
    jaxserve bench latency     offline: one batch through `LLM.generate`, end-to-end latency percentiles
    jaxserve bench throughput  offline: N prompts through `LLM.generate`, requests/s and tokens/s

The server benchmark needs nothing beyond the standard library (its HTTP client is `bench.http`), so it
runs from a bare install against a server on another machine; the offline ones build an `LLM`.
"""
