"""Shared fixtures of the router tests: real tokenizers, trained and loaded from disk."""

from __future__ import annotations

import pytest
from tokenizers import normalizers, pre_tokenizers

from tests.router.trained_tokenizers import (
    CHATML,
    LLAMA,
    LLAMA_TEMPLATE,
    lstrip_specials,
    metaspace_first,
    overlapping,
    trained,
    with_bos,
)
from tracker.core.chat import CHATML_TEMPLATE
from tracker.core.tokens import Tokenizer


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    """Real tokenizers trained here, saved to disk and loaded the way a deployment loads them."""
    root = tmp_path_factory.mktemp("tokenizers")
    made = {
        "chatml-bpe": (trained(CHATML), CHATML_TEMPLATE, "<|im_end|>", None),
        "llama-bos": (trained(LLAMA, post=with_bos), LLAMA_TEMPLATE, "<|eot_id|>", "<s>"),
        "nfkc-prefix-space": (
            trained(
                CHATML,
                pre=pre_tokenizers.ByteLevel(add_prefix_space=True),
                normalizer=normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]),
            ),
            CHATML_TEMPLATE,
            "<|im_end|>",
            None,
        ),
        "overlapping": (overlapping(), CHATML_TEMPLATE, "<|im_end|>", None),
        "metaspace-first": (metaspace_first(), CHATML_TEMPLATE, "<|im_end|>", None),
        "lstrip-specials": (lstrip_specials(), CHATML_TEMPLATE, "<|im_end|>", None),
    }
    out = {"builtin": Tokenizer.builtin()}
    for name, (hf, template, eos, bos) in made.items():
        folder = root / name
        folder.mkdir()
        hf.save(str(folder / "tokenizer.json"))
        (folder / "chat_template.jinja").write_text(template)
        out[name] = Tokenizer.from_files(folder, eos_token=eos, bos_token=bos)
    return out
