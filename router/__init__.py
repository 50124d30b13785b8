"""kvrouter's OpenAI-compatible router: policy, load sharing, estimates, tokenization."""
