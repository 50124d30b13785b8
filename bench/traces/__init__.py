"""Request traces for ``kvrouter bench --workload trace`` (Mooncake FAST'25 JSONL format)."""
