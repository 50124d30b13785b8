"""How a tokenizer's input splits into pieces that encode independently; pure analysis.

HuggingFace ``tokenizers`` first splits its input at added tokens (``<|im_start|>``...),
then normalizes, pre-tokenizes and encodes each piece on its own; a post-processor may then
wrap the whole sequence (BOS/EOS). So the ids of a text are the concatenation of the ids of
its pieces, as long as every stage treats a piece the same wherever it sits in the text.
:func:`plan_segments` decides from the tokenizer's own configuration whether that holds:
added tokens without ``lstrip``/``rstrip``/``single_word`` matching (:func:`split_pieces`
re-implements the tokenizer's leftmost-longest match over its non-normalized added tokens),
no truncation or padding, and normalizer, pre-tokenizer and model of kinds that are
piece-local (Metaspace with ``prepend_scheme="first"`` is not), confirmed by a self-check on
probe strings. With ``add_special_tokens=True`` the post-processor must also be a fixed
prefix and suffix, measured on probes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

_NORMALIZERS: Final = frozenset(
    [
        "BertNormalizer",
        "ByteLevel",
        "Lowercase",
        "NFC",
        "NFD",
        "NFKC",
        "NFKD",
        "Nmt",
        "Precompiled",
        "Prepend",
        "Replace",
        "Sequence",
        "Strip",
        "StripAccents",
    ]
)
_PRE_TOKENIZERS: Final = frozenset(
    [
        "BertPreTokenizer",
        "ByteLevel",
        "CharDelimiterSplit",
        "Digits",
        "Metaspace",
        "Punctuation",
        "Sequence",
        "Split",
        "UnicodeScripts",
        "Whitespace",
        "WhitespaceSplit",
    ]
)
_MODELS: Final = frozenset(["BPE", "Unigram", "WordLevel", "WordPiece"])
_PROCESSORS: Final = frozenset(
    ["BertProcessing", "ByteLevel", "RobertaProcessing", "Sequence", "TemplateProcessing"]
)
_CHILDREN: Final = ("normalizers", "pretokenizers", "processors")
_PROBE_TEXTS: Final = ("", " ", "a", "hello  world\n", "\n\n ", "x y\tz", "Ünïcödé ✓ 漢字", "  ")


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """How a tokenizer's input may be split into independently encoded pieces.

    ``splitter`` is None when it may not (``reason`` says why): every text is then one
    piece. ``prefix``/``suffix`` are what the post-processor adds with
    ``add_special_tokens=True``; None when that is not a fixed wrapper (``prompt_reason``).
    """

    splitter: re.Pattern[str] | None
    added: Mapping[str, int]
    prefix: tuple[int, ...] | None
    suffix: tuple[int, ...]
    reason: str = ""
    prompt_reason: str = ""


def _unsupported(node: Any, allowed: frozenset[str], what: str) -> str:
    """Why a tokenizer.json component is not piece-local ('' if it is)."""
    if node is None:
        return ""
    kind = node.get("type")
    if kind not in allowed:
        return f"{what} {kind!r} is not known to treat pieces independently"
    if kind == "Metaspace" and node.get("prepend_scheme") == "first":
        return "Metaspace prepend_scheme='first' depends on a piece's position"
    if kind == "BPE" and node.get("dropout"):
        return "BPE dropout is random"
    for key in _CHILDREN:
        for child in node.get(key) or ():
            reason = _unsupported(child, allowed, what)
            if reason:
                return reason
    return ""


def split_pieces(text: str, plan: SegmentPlan) -> list[str | int]:
    """``text`` split as the tokenizer splits it: text pieces and added-token ids."""
    if plan.splitter is None:
        return [text] if text else []
    out: list[str | int] = []
    start = 0
    for match in plan.splitter.finditer(text):
        if match.start() > start:
            out.append(text[start : match.start()])
        out.append(plan.added[match.group()])
        start = match.end()
    if start < len(text):
        out.append(text[start:])
    return out


def _encode_pieces(hf: Any, pieces: list[str | int]) -> list[int]:
    texts = [p for p in pieces if isinstance(p, str)]
    encoded = iter(hf.encode_batch(texts, add_special_tokens=False)) if texts else iter(())
    ids: list[int] = []
    for piece in pieces:
        ids.extend(next(encoded).ids if isinstance(piece, str) else (piece,))
    return ids


def _wrapper(hf: Any, plan: SegmentPlan) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(prefix, suffix) the post-processor adds around any sequence, if that is all it does."""
    count = hf.num_special_tokens_to_add(False)
    empty = hf.post_process(hf.encode("", add_special_tokens=False)).ids
    found: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for probe in ("a", "hello world"):
        inner = hf.encode(probe, add_special_tokens=False)
        wrapped = hf.post_process(inner).ids
        ids = inner.ids
        if len(wrapped) != len(ids) + count or len(empty) != count:
            return None
        spots = [p for p in range(count + 1) if wrapped[p : p + len(ids)] == ids]
        if len(spots) != 1:
            return None
        found.add((tuple(wrapped[: spots[0]]), tuple(wrapped[spots[0] + len(ids) :])))
    if len(found) != 1:
        return None
    prefix, suffix = found.pop()
    return (prefix, suffix) if list(prefix + suffix) == empty else None


def plan_segments(hf: Any) -> SegmentPlan:
    """Decide whether (and how) ``hf`` (a ``tokenizers.Tokenizer``) may encode piecewise."""
    config = json.loads(hf.to_str())
    # Only tokens matched before normalization split the text; the others are matched inside
    # each piece, which encoding the piece alone reproduces.
    tokens = [t for t in config.get("added_tokens") or () if not t.get("normalized")]
    added = {t["content"]: t["id"] for t in tokens}
    reason = ""
    if config.get("truncation") or config.get("padding"):
        reason = "truncation or padding is enabled"
    elif getattr(hf, "encode_special_tokens", False):
        reason = "encode_special_tokens is set"
    elif not added:
        reason = "the tokenizer has no added tokens to split at"
    elif "" in added:
        reason = "an added token is empty"
    elif any(t.get(k) for t in tokens for k in ("lstrip", "rstrip", "single_word")):
        reason = "an added token strips whitespace or matches whole words only"
    else:
        reason = (
            _unsupported(config.get("normalizer"), _NORMALIZERS, "normalizer")
            or _unsupported(config.get("pre_tokenizer"), _PRE_TOKENIZERS, "pre-tokenizer")
            or _unsupported(config.get("model"), _MODELS, "model")
            or _unsupported(config.get("post_processor"), _PROCESSORS, "post-processor")
        )
    if reason:
        return SegmentPlan(None, {}, None, (), reason=reason, prompt_reason=reason)
    # Longest first: at one position Python's re takes the first alternative that matches,
    # which makes the scan leftmost-longest like the tokenizer's Aho-Corasick automaton.
    alternatives = sorted(added, key=len, reverse=True)
    splitter = re.compile("|".join(re.escape(a) for a in alternatives))
    plan = SegmentPlan(splitter, added, None, ())
    probes = list(_PROBE_TEXTS)
    for token in alternatives[:8]:
        probes += [f"a{token}b", f" {token} \n{token}{token} z{token}"]
    for probe in probes:
        if (
            _encode_pieces(hf, split_pieces(probe, plan))
            != hf.encode(probe, add_special_tokens=False).ids
        ):
            reason = f"self-check failed on {probe!r}"
            return SegmentPlan(None, {}, None, (), reason=reason, prompt_reason=reason)
    wrapper = _wrapper(hf, plan)
    if wrapper is None:
        return SegmentPlan(
            splitter, added, None, (), prompt_reason="the post-processor is not a fixed wrapper"
        )
    prefix, suffix = wrapper
    for probe in probes:
        ids = [*prefix, *_encode_pieces(hf, split_pieces(probe, plan)), *suffix]
        if ids != hf.encode(probe, add_special_tokens=True).ids:
            reason = f"self-check with special tokens failed on {probe!r}"
            return SegmentPlan(splitter, added, None, (), prompt_reason=reason)
    return SegmentPlan(splitter, added, prefix, suffix)
