"""Build a tiny random-weight Qwen2 model that vLLM's CPU build can serve: no download.

Run with the Python that has ``transformers`` and ``tokenizers`` (the vLLM virtualenv)::

    .venv-vllm/bin/python scripts/tiny_model.py DIR

``DIR`` gets ``config.json`` + ``model.safetensors`` (hidden 128, 2 layers, 2 attention heads
of 64 and 1 KV head: vLLM's CPU attention kernels reject a head size of 16), a byte-level BPE
``tokenizer.json`` of 4,096 tokens trained on generated text (with ``<|endoftext|>``,
``<|im_start|>``, ``<|im_end|>``) and a ``tokenizer_config.json`` with a ChatML template.
Deterministic: the same text, the same merges, the same seed.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB = 4096
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def corpus(lines: int = 20_000, seed: int = 0) -> list[str]:
    """Word-like text: the tokenizer learns merges of a language-shaped distribution."""
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))) for _ in range(lines)]


def build(out: Path) -> None:
    # only the vLLM virtualenv has these (not kvrouter's): imported when the model is built
    import torch  # noqa: PLC0415
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415
    from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(t)): {"content": t, "special": True} for t in SPECIAL
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(0)
    model_config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.token_to_id("<|im_end|>"),
        bos_token_id=tokenizer.token_to_id("<|endoftext|>"),
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    Qwen2ForCausalLM(model_config).to(torch.bfloat16).save_pretrained(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_model.py DIR")
    build(Path(sys.argv[1]))
    print(f"tiny model in {sys.argv[1]}")
