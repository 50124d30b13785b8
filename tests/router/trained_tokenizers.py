"""Real tokenizers trained for the tokenization tests: their specials, templates and corpus."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import (
    AddedToken,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers import Tokenizer as HFTokenizer

CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA = ["<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CORPUS = [
    "You are a helpful assistant. Answer briefly and precisely.",
    "KV-cache aware routing sends a request to the replica that holds its prefix.",
    "The quick brown fox jumps over the lazy dog; 12345 67890!",
    "Héllo wörld, naïve café — ünïcödé text, 漢字かな, emoji 🙂 and tabs\tand\nnewlines.",
    "def route(request):\n    return min(replicas, key=expected_ttft)\n",
]


def trained(
    specials: list[str],
    *,
    pre: Any = None,
    normalizer: Any = None,
    post: Callable[[HFTokenizer], Any] | None = None,
) -> HFTokenizer:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre or pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    if normalizer is not None:
        hf.normalizer = normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(CORPUS * 10, trainer)
    if post is not None:
        hf.post_processor = post(hf)
    return hf


def with_bos(hf: HFTokenizer) -> Any:
    return processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", hf.token_to_id("<s>"))]
    )


def metaspace_first() -> HFTokenizer:
    hf = HFTokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *CHATML])
    hf.train_from_iterator(CORPUS * 10, trainer)
    return hf


def overlapping() -> HFTokenizer:
    """Added tokens that overlap the specials: the split must be leftmost-longest like HF's."""
    hf = trained(CHATML, normalizer=normalizers.Lowercase())
    overlapping = ["<|im", "_end|>", "<|im_start|>user\n", "t<|", "end|>\n<"]
    hf.add_tokens([AddedToken(t, normalized=False) for t in overlapping])
    hf.add_tokens([AddedToken("hello world", normalized=True)])
    return hf


def lstrip_specials() -> HFTokenizer:
    hf = trained([])
    hf.add_special_tokens([AddedToken(t, lstrip=True, rstrip=True) for t in CHATML])
    return hf
