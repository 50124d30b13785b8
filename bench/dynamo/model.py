"""The model directory Dynamo's frontend tokenizes from, exported from the fleet's tokenizer.

Dynamo tokenizes chat requests itself (its chat template rendered with minijinja, then its
HuggingFace tokenizer), so its block hashes meet the engines' only if its token ids are the
engines' own: ``tokenizer.json`` is the project's tokenizer saved as is, and
``tokenizer_config.json`` carries the same chat template and special tokens
(:mod:`tracker.core.tokens`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tracker.core.chat import CHATML_TEMPLATE
from tracker.core.tokens import Tokenizer


def write_model_dir(
    path: Path,
    *,
    context_length: int,
    tokenizer: Tokenizer | None = None,
    chat_template: str = CHATML_TEMPLATE,
) -> Path:
    """``tokenizer.json``, ``tokenizer_config.json``, ``config.json`` and
    ``generation_config.json`` in ``path`` (created); returns ``path``.

    :param context_length: the engines' longest prompt plus output, which Dynamo enforces.
    :param tokenizer: / :param chat_template: the engines' (default: the simulated fleet's,
        :meth:`Tokenizer.builtin` and its ChatML template).
    """
    tokenizer = tokenizer or Tokenizer.builtin()
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.hf.save(str(path / "tokenizer.json"))
    eos_id = tokenizer.eos_token_id
    files: dict[str, dict[str, Any]] = {
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": chat_template,
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "model_max_length": context_length,
        },
        "config.json": {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": tokenizer.vocab_size,
            "max_position_embeddings": context_length,
            "eos_token_id": eos_id,
        },
        "generation_config.json": {"eos_token_id": eos_id},
    }
    for name, content in files.items():
        (path / name).write_text(json.dumps(content, indent=2) + "\n")
    return path
