"""kvrouter's shared core: vLLM KV-event codec, block keys, tokenizer, and the block index."""
