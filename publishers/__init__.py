"""Event publishers: the simulated vLLM engine (:mod:`publishers.sim`) and the shim that attaches
real vLLM servers (:mod:`publishers.vllm`), with what both use: vLLM's ZeroMQ KV-event
publisher and endpoint rules, registry heartbeats, and the commands' settings."""
