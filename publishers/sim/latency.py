"""The simulated engine's step-latency model: :class:`LatencyProfile` prices one engine step
from the work scheduled in it, :func:`fit_profile` fits a profile to measured forward passes,
and :data:`PROFILES` holds the fitted ones (``llama-8b``, ``llama-70b``).

The model, its fit and the measurements behind it: docs/architecture.md, "Simulated engine".
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

# A row is compute-bound when it takes at least this much more than the decode floor.
_COMPUTE_BOUND: Final = 1.25
# Knot of a warm-prefill pair: context before the mean of the two suffix lengths (32, 128).
_WARM_SUFFIXES: Final = (32, 128)


@dataclass(frozen=True)
class LatencyProfile:
    """Parameters of one model's step-latency model (all times in milliseconds).

    A step lasts ``max(floor, compute) + kv_ms_per_token * (sum of decode contexts)``, where
    ``compute = step_compute_ms + token_ms * N + attention_ms * A`` (``N`` tokens computed,
    ``A`` pairs of a computed token and a context token it attends to) and ``floor`` is
    ``floor_ms``, times :meth:`prefill_floor_at` the largest earlier context when it prefills.

    Attributes:
        name: profile name, e.g. ``llama-8b``.
        floor_ms: least time of any step (the decode-step floor); overridable.
        kv_ms_per_token: added per context token of each decoding sequence (KV reads).
        step_compute_ms: fixed compute of a step with work (from the cold-prefill fit).
        token_ms: compute per token (new prefill token or decode token).
        attention_ms: compute per (token, attended context token) pair.
        prefill_floor: ``(cached context, multiple of floor_ms)`` knots, ascending; linear
            between knots, extrapolated along the last segment (never downwards).
    """

    name: str
    floor_ms: float
    kv_ms_per_token: float
    step_compute_ms: float
    token_ms: float
    attention_ms: float
    prefill_floor: tuple[tuple[float, float], ...]

    def prefill_floor_at(self, context: float) -> float:
        """Multiple of ``floor_ms`` a prefill step pays with ``context`` cached tokens."""
        knots = self.prefill_floor
        if not knots:
            return 1.0
        i = bisect_right([c for c, _ in knots], context)
        if i == 0:
            return knots[0][1]
        if i == len(knots):
            if len(knots) == 1:
                return knots[0][1]
            (c0, r0), (c1, r1) = knots[-2], knots[-1]
            return r1 + max(0.0, (r1 - r0) / (c1 - c0)) * (context - c1)
        (c0, r0), (c1, r1) = knots[i - 1], knots[i]
        return r0 + (r1 - r0) * (context - c0) / (c1 - c0)

    def step_ms(self, prefill: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        """Duration of one engine step.

        Args:
            prefill: per prefilling sequence, (new tokens computed this step, earlier context
                those tokens attend to: prefix-cache hits plus earlier chunks).
            decode_contexts: context length of each decoding sequence.
        """
        if not prefill and not decode_contexts:
            return 0.0
        tokens = len(decode_contexts)
        kv_tokens = sum(decode_contexts)
        attended = float(kv_tokens)
        for new, context in prefill:
            tokens += new
            attended += new * (context + new / 2)
        compute = self.step_compute_ms + self.token_ms * tokens + self.attention_ms * attended
        floor = self.floor_ms
        if prefill:
            floor *= self.prefill_floor_at(max(context for _, context in prefill))
        return max(floor, compute) + self.kv_ms_per_token * kv_tokens

    @property
    def attention_tokens(self) -> float:
        """The context length at which a token's attention costs as much as the rest of its
        forward pass (the routers' ``--attention-tokens``); 0 without an attention term."""
        return self.token_ms / self.attention_ms if self.attention_ms > 0 else 0.0

    def lone_prefill_ms(self, tokens: int, max_num_batched_tokens: int, cached: int = 0) -> float:
        """A lone prompt's prefill on an idle engine: its ``tokens - cached`` uncached tokens
        in chunks of ``max_num_batched_tokens``, one step each, nothing else in the batch."""
        ms, done = 0.0, cached
        while done < tokens:
            chunk = min(max_num_batched_tokens, tokens - done)
            ms += self.step_ms([(chunk, done)], [])
            done += chunk
        return ms


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the systems here are 2x2 and 3x3)."""
    n = len(rhs)
    rows = [[*row, value] for row, value in zip(matrix, rhs, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(n):
            if r != col:
                factor = rows[r][col] / rows[col][col]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col], strict=True)]
    return [rows[i][n] / rows[i][i] for i in range(n)]


def _relative_lsq(features: list[list[float]], targets: list[float]) -> list[float]:
    """Least squares minimising the sum of squared *relative* residuals."""
    k = len(features[0])
    normal = [[0.0] * k for _ in range(k)]
    rhs = [0.0] * k
    for x, y in zip(features, targets, strict=True):
        w = 1.0 / (y * y)
        for i in range(k):
            rhs[i] += w * x[i] * y
            for j in range(k):
                normal[i][j] += w * x[i] * x[j]
    return _solve(normal, rhs)


def _harmonic(values: Sequence[float]) -> float:
    return len(values) / sum(1.0 / v for v in values)


def fit_profile(
    name: str, rows: Sequence[Mapping[str, Any]], *, layer_scale: float = 1.0
) -> LatencyProfile:
    """Fit a profile to the ``rows`` of one model in ``h200-prefill.json``.

    Args:
        name: name of the resulting profile.
        rows: the model's ``rows`` (``tokens`` and ``{cold_prefill, warm_prefill_suffix_32,
            warm_prefill_suffix_128, decode_step}.median_ms``).
        layer_scale: multiply every time by this (2.0 turns 40 measured layers into 80).
    """

    def ms(row: Mapping[str, Any], key: str) -> float:
        return float(row[key]["median_ms"]) * layer_scale

    decode = [(float(r["tokens"]), ms(r, "decode_step")) for r in rows]
    floor, kv = _relative_lsq([[1.0, t] for t, _ in decode], [y for _, y in decode])
    if kv < 0:  # a flat (or noisy, falling) decode curve: no per-token KV term
        kv, floor = 0.0, _harmonic([y for _, y in decode])
    cold = [(float(r["tokens"]), ms(r, "cold_prefill")) for r in rows]
    bound = [(t, y) for t, y in cold if y > _COMPUTE_BOUND * floor]
    c0, per_token, attention = _relative_lsq(
        [[1.0, t, t * t / 2] for t, _ in bound], [y for _, y in bound]
    )
    floor_bound = [y for t, y in cold if y <= _COMPUTE_BOUND * floor]
    knots = [(0.0, _harmonic(floor_bound) / floor if floor_bound else 1.0)]
    shift = sum(_WARM_SUFFIXES) / len(_WARM_SUFFIXES)
    for row in rows:
        warm = [ms(row, f"warm_prefill_suffix_{n}") for n in _WARM_SUFFIXES]
        knots.append((float(row["tokens"]) - shift, _harmonic(warm) / floor))
    return LatencyProfile(
        name=name,
        floor_ms=floor,
        kv_ms_per_token=kv,
        step_compute_ms=c0,
        token_ms=per_token,
        attention_ms=attention,
        prefill_floor=tuple(sorted(knots)),
    )


# Generated by fit_profile from shared/calibration/h200-prefill.json, rounded to 6 digits:
#   llama-8b  = fit_profile("llama-8b", models["llama-8b"]["rows"])
#   llama-70b = fit_profile("llama-70b", models["llama-70b-40of80-layers"]["rows"], layer_scale=2)
PROFILES: Final[dict[str, LatencyProfile]] = {
    "llama-8b": LatencyProfile(
        name="llama-8b",
        floor_ms=20.5823,
        kv_ms_per_token=0.0,
        step_compute_ms=3.30954,
        token_ms=0.0270386,
        attention_ms=1.03015e-06,
        prefill_floor=(
            (0.0, 1.08458),
            (176.0, 1.52818),
            (432.0, 1.43205),
            (944.0, 1.14118),
            (1968.0, 1.21761),
            (4016.0, 1.52157),
            (8112.0, 1.21563),
            (16304.0, 1.87453),
        ),
    ),
    "llama-70b": LatencyProfile(
        name="llama-70b",
        floor_ms=50.3609,
        kv_ms_per_token=0.000787218,
        step_compute_ms=15.9616,
        token_ms=0.230224,
        attention_ms=5.78513e-06,
        prefill_floor=(
            (0.0, 1.0),
            (176.0, 1.15356),
            (432.0, 1.1509),
            (944.0, 1.37156),
            (1968.0, 1.32117),
            (4016.0, 1.49074),
            (8112.0, 1.92761),
            (16304.0, 2.82156),
        ),
    ),
}


def load_profile(name: str, *, floor_ms: float | None = None) -> LatencyProfile:
    """The named profile, with its step floor replaced by ``floor_ms`` when given.

    Use a lower floor to model an engine with CUDA graphs (vLLM decodes an 8B model in
    ~5-8 ms per step); the context-dependent prefill floor keeps its shape (same multiples).
    """
    try:
        profile = PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown latency profile {name!r}; known: {sorted(PROFILES)}") from None
    if floor_ms is None:
        return profile
    if floor_ms < 0:
        raise ValueError(f"floor_ms must be >= 0, got {floor_ms}")
    return dataclasses.replace(profile, floor_ms=floor_ms)
