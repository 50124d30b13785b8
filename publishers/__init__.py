"""Event publishers: a simulated vLLM engine with vLLM's ZeroMQ KV-event publisher, and the
shim that attaches real vLLM servers to kvrouter."""
