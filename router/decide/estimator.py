"""Online estimates of prefill speed, learned from the TTFTs the router sees.

``ttft_ms = floor_ms + prefill_ms_per_token * tokens_ahead``, fitted by :class:`SpeedModel`
with the seed as a prior; :class:`SpeedBook` keeps one per model, pooled over its replicas
(per-replica fits biased routing: docs/architecture.md, "Score").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Final

from router.decide.policy_types import DEFAULT_SPEED, SpeedEstimate

_MIN_BAND_MS: Final = 0.5
_REL_BAND: Final = 0.05
_NOISE_PSEUDO: Final = 2.0
_FADE_STEP_S: Final = 0.5  # refit for fading at most this often


class SpeedModel:
    """One speed estimate, updated one observed TTFT at a time.

    ``tokens_ahead`` is the prefill work in front of the request's first token when it was
    dispatched (:attr:`router.decide.policy_types.Score.work_tokens`). The fit is exponentially
    weighted least squares (weighted means and co-moments updated with West's stable
    recurrence), with:

    * the seed as a Gaussian prior (sd ``seed_floor_sd_ms`` on the floor, ``seed_slope_sd``
      times the seed's slope on the slope), weighed against the data by the observed
      residual noise: with no data the estimate is the seed; the slope follows the data only
      as far as the spread of ``tokens_ahead`` makes it identifiable (a replica that only sees
      500-token prompts learns its level and keeps the seed's slope);
    * Huber-style clamping: a residual beyond ``outlier_k`` mean absolute residuals is clipped
      (a TTFT that includes a stall counts as a large, not a huge, error); non-finite or
      negative inputs are ignored;
    * hard bounds on both parameters;
    * evidence that fades with time (``idle_half_life_s``): a replica believed slow gets no
      requests, so without fading a few slow TTFTs would keep it out for good; faded, its
      estimate drifts back to the seed and it is measured anew.
    """

    __slots__ = (
        "_at",
        "_cxx",
        "_cxy",
        "_cyy",
        "_decay",
        "_estimate",
        "_mad",
        "_mx",
        "_my",
        "_w",
        "idle_half_life_s",
        "max_floor_ms",
        "max_ms_per_token",
        "min_floor_ms",
        "min_ms_per_token",
        "observations",
        "outlier_k",
        "rejected",
        "seed",
        "seed_floor_sd_ms",
        "seed_slope_sd",
    )

    def __init__(
        self,
        seed: SpeedEstimate = DEFAULT_SPEED,
        *,
        half_life: int = 50,
        min_ms_per_token: float = 0.001,
        max_ms_per_token: float = 10.0,
        min_floor_ms: float = 0.0,
        max_floor_ms: float = 10_000.0,
        seed_floor_sd_ms: float = 10.0,
        seed_slope_sd: float = 0.5,
        outlier_k: float = 4.0,
        idle_half_life_s: float = 10.0,
    ) -> None:
        """Start at ``seed``.

        :param half_life: an observation's weight halves after this many newer ones.
        :param min_ms_per_token: / :param max_ms_per_token: bounds of the learned slope.
        :param min_floor_ms: / :param max_floor_ms: bounds of the learned floor.
        :param seed_floor_sd_ms: how far off the seed's floor may be (prior sd, ms).
        :param seed_slope_sd: how far off the seed's slope may be (prior sd, relative).
        :param outlier_k: residuals beyond this many mean absolute residuals are clipped.
        :param idle_half_life_s: all the evidence's weight halves every this many seconds
            (when :meth:`observe` and :meth:`estimate` are given the time).
        """
        if half_life < 1:
            raise ValueError(f"half_life must be >= 1, got {half_life}")
        if not 0 <= min_ms_per_token <= max_ms_per_token:
            raise ValueError("need 0 <= min_ms_per_token <= max_ms_per_token")
        if not 0 <= min_floor_ms <= max_floor_ms:
            raise ValueError("need 0 <= min_floor_ms <= max_floor_ms")
        if seed_floor_sd_ms <= 0 or seed_slope_sd <= 0 or outlier_k <= 0:
            raise ValueError("seed_floor_sd_ms, seed_slope_sd and outlier_k must be > 0")
        if idle_half_life_s <= 0:
            raise ValueError("idle_half_life_s must be > 0")
        self.min_ms_per_token = min_ms_per_token
        self.max_ms_per_token = max_ms_per_token
        self.min_floor_ms = min_floor_ms
        self.max_floor_ms = max_floor_ms
        self.seed = self._clamp(seed.floor_ms, seed.prefill_ms_per_token)
        self.seed_floor_sd_ms = seed_floor_sd_ms
        self.seed_slope_sd = seed_slope_sd
        self.outlier_k = outlier_k
        self.idle_half_life_s = idle_half_life_s
        self._at: float | None = None
        self._decay = 0.5 ** (1.0 / half_life)
        self._w = self._mx = self._my = self._cxx = self._cxy = self._cyy = 0.0
        self._mad = max(self.seed.floor_ms, 1.0)
        self._estimate = self.seed
        self.observations = 0
        self.rejected = 0

    def _clamp(self, floor_ms: float, ms_per_token: float) -> SpeedEstimate:
        return SpeedEstimate(
            floor_ms=min(max(floor_ms, self.min_floor_ms), self.max_floor_ms),
            prefill_ms_per_token=min(
                max(ms_per_token, self.min_ms_per_token), self.max_ms_per_token
            ),
        )

    @property
    def samples(self) -> float:
        """Effective number of observations behind the estimate (decayed weight)."""
        return self._w

    @property
    def spread_tokens(self) -> float:
        """Weighted standard deviation of the observed ``tokens_ahead``."""
        return math.sqrt(self._cxx / self._w) if self._w > 0 else 0.0

    def estimate(self, now: float | None = None) -> SpeedEstimate:
        """The current estimate: the seed until data says otherwise, always within bounds.

        :param now: the clock (seconds): the evidence fades by the time since last asked.
        """
        if now is not None:
            self._fade(now)
        return self._estimate

    def _fade(self, now: float) -> None:
        # Scaling every weight alike keeps the weighted means and scales the co-moments.
        if self._at is None or now < self._at:
            self._at = now
            return
        elapsed = now - self._at
        if elapsed < _FADE_STEP_S:
            return
        self._at = now
        if self._w <= 0:
            return
        fade = 0.5 ** (elapsed / self.idle_half_life_s)
        self._w *= fade
        self._cxx *= fade
        self._cxy *= fade
        self._cyy *= fade
        self._estimate = self._fit()

    def _fit(self) -> SpeedEstimate:
        # Posterior means under the seed prior: prior weight = noise variance / prior variance,
        # with the noise variance from the fit's residuals (shrunk towards seed_floor_sd_ms
        # while there are few observations: two points fit any line exactly).
        explained = self._cxy**2 / self._cxx if self._cxx > 0 else 0.0
        residual = max(self._cyy - explained, 0.0)
        noise_var = (residual + _NOISE_PSEUDO * self.seed_floor_sd_ms**2) / (
            self._w + _NOISE_PSEUDO
        )
        noise = max(math.sqrt(noise_var), _MIN_BAND_MS)
        seed = self.seed
        slope_prior = (noise / (self.seed_slope_sd * max(seed.prefill_ms_per_token, 1e-9))) ** 2
        slope = (self._cxy + slope_prior * seed.prefill_ms_per_token) / (self._cxx + slope_prior)
        slope = min(max(slope, self.min_ms_per_token), self.max_ms_per_token)
        floor_prior = (noise / self.seed_floor_sd_ms) ** 2
        fitted_floor = self._my - slope * self._mx
        floor = (self._w * fitted_floor + floor_prior * seed.floor_ms) / (self._w + floor_prior)
        return self._clamp(floor, slope)

    def observe(
        self, ttft_ms: float, prefill_tokens_ahead: float, now: float | None = None
    ) -> None:
        """Learn from one request: its TTFT and the prefill work ahead of it at dispatch.

        :param now: the clock (seconds), for fading (see ``idle_half_life_s``).
        """
        x, y = float(prefill_tokens_ahead), float(ttft_ms)
        if not (math.isfinite(x) and math.isfinite(y)) or x < 0 or y < 0:
            self.rejected += 1
            return
        if now is not None:
            self._fade(now)
        predicted = self._estimate.prefill_ms(x)
        band = self.outlier_k * max(self._mad, _MIN_BAND_MS, _REL_BAND * predicted)
        residual = min(max(y - predicted, -band), band)
        y = predicted + residual
        decay = self._decay
        self._mad = decay * self._mad + (1.0 - decay) * abs(residual)
        # West's weighted incremental update of means and co-moments.
        self._w = decay * self._w + 1.0
        share = 1.0 / self._w
        dx = x - self._mx
        self._mx += share * dx
        dy = y - self._my
        self._my += share * dy
        self._cxx = decay * self._cxx + dx * (x - self._mx)
        self._cxy = decay * self._cxy + dx * (y - self._my)
        self._cyy = decay * self._cyy + dy * (y - self._my)
        self.observations += 1
        self._estimate = self._fit()


class SpeedBook:
    """Per-replica :class:`SpeedModel` registry; unknown replicas get the seed."""

    def __init__(
        self,
        seed: SpeedEstimate = DEFAULT_SPEED,
        *,
        half_life: int = 50,
        clock: Callable[[], float] = time.monotonic,
        **bounds: float,
    ) -> None:
        """:param bounds: further :class:`SpeedModel` keyword arguments (bounds, prior).

        :param clock: seconds, for the models' fading.
        """
        self.seed = seed
        self.clock = clock
        self._half_life = half_life
        self._bounds = bounds
        self._models: dict[str, SpeedModel] = {}
        SpeedModel(seed, half_life=half_life, **bounds)  # validate the options now

    def model(self, replica: str) -> SpeedModel:
        """The replica's model, created from the seed on first use."""
        model = self._models.get(replica)
        if model is None:
            model = self._models[replica] = SpeedModel(
                self.seed, half_life=self._half_life, **self._bounds
            )
        return model

    def get(self, replica: str) -> SpeedEstimate:
        """The replica's current estimate (the seed if nothing was observed)."""
        model = self._models.get(replica)
        return model.estimate(self.clock()) if model is not None else self.seed

    def observe(self, replica: str, ttft_ms: float, tokens_ahead: float) -> None:
        """Record one TTFT of ``replica``; see :meth:`SpeedModel.observe`."""
        self.model(replica).observe(ttft_ms, tokens_ahead, self.clock())

    def forget(self, replica: str) -> None:
        """Drop a departed replica's model (a returning one starts from the seed)."""
        self._models.pop(replica, None)

    def estimates(self) -> dict[str, SpeedEstimate]:
        """Every known replica's estimate, for introspection."""
        now = self.clock()
        return {replica: model.estimate(now) for replica, model in self._models.items()}
