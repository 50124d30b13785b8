"""English-like text, and a byte-level BPE tokenizer trained on it: offline benchmark inputs.

The text is made of pseudo-words (English syllables) drawn from a Zipf distribution, mixed with
the most common English words, numbers and punctuation, so that a 32k BPE vocabulary trained
on it keeps frequent words whole and splits rare ones, as real tokenizers do on English. The
tokenizer copies the structure of Qwen2's ``tokenizer.json`` (NFC, a regex split,
byte-level, ChatML special tokens and template) but is NOT a production model's tokenizer:
its ids mean nothing outside the benchmark, only its cost is realistic.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Final

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from tracker.core.chat import CHATML_TEMPLATE

SPECIAL_TOKENS: Final = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2's pre-tokenizer split (the GPT-4 style pattern, single digits).
SPLIT_PATTERN: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split(" "))


_COMMON: Final = _words(
    "the of and to a in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were their one all we can her has there been if more when will "
    "would who so no what how why your should could about into than then them these"
)
_ONSETS: Final = _words(
    " b c d f g h j k l m n p r s t v w st tr pl gr ch sh th br cr fl sp qu z x"
)
_NUCLEI: Final = _words("a e i o u ea ou ai io ee y au")
_CODAS: Final = _words("  n r s t l nd st ng ck m rs tion ment ing ed ly er x ph gh")


class Lexicon:
    """Pseudo-English words with Zipf frequencies; sentences and texts drawn from them."""

    def __init__(self, seed: int = 7, words: int = 100_000, exponent: float = 1.0) -> None:
        rng = random.Random(seed)

        def word() -> str:
            syllables = rng.choice((1, 1, 1, 2, 2, 2, 3))
            return "".join(
                rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                for _ in range(syllables)
            )

        self.words = list(dict.fromkeys([*_COMMON, *(word() for _ in range(words))]))
        self._cum = list(
            itertools.accumulate(1 / (i + 1) ** exponent for i in range(len(self.words)))
        )

    def sentence(self, rng: random.Random, end: str = "") -> str:
        n = rng.randint(5, 22)
        words = rng.choices(self.words, cum_weights=self._cum, k=n)
        words[0] = words[0].capitalize()
        if rng.random() < 0.2:
            words.insert(rng.randrange(n), str(rng.randrange(10_000)))
        if rng.random() < 0.3:
            words[rng.randrange(len(words))] += ","
        return " ".join(words) + (end or rng.choice(".....?!:"))

    def paragraph(self, rng: random.Random) -> str:
        return " ".join(self.sentence(rng) for _ in range(rng.randint(2, 7)))

    def text(self, rng: random.Random, chars: int) -> str:
        """Paragraphs (blank-line separated) until the text is at least ``chars`` long."""
        parts: list[str] = []
        size = 0
        while size < chars:
            parts.append(self.paragraph(rng))
            size += len(parts[-1]) + 2
        return "\n\n".join(parts)

    def question(self, rng: random.Random, chars: int) -> str:
        """Sentences ending in a question, about ``chars`` long."""
        parts = [self.sentence(rng, ".")]
        while sum(map(len, parts)) < chars:
            parts.append(self.sentence(rng, "."))
        parts[-1] = parts[-1][:-1] + "?"
        return " ".join(parts)


def train_tokenizer(
    lexicon: Lexicon, directory: Path, *, vocab_size: int = 32_000, paragraphs: int = 10_000
) -> Path:
    """Train a byte-level BPE on ``paragraphs`` of text; write tokenizer.json and its config.

    Returns the directory (``Tokenizer.from_files`` loads it, ChatML template included).
    """
    rng = random.Random(11)
    corpus = [lexicon.paragraph(rng) for _ in range(paragraphs)]
    hf = Tokenizer(models.BPE())
    hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.post_processor = processors.ByteLevel(trim_offsets=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(corpus, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    hf.save(str(directory / "tokenizer.json"))
    config = {
        "chat_template": CHATML_TEMPLATE,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory
