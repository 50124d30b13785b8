"""The simulated vLLM engine: its paged KV cache, scheduler and latency model, its
OpenAI-compatible server, and ``kvrouter replica``, the process that runs a fleet of them."""
