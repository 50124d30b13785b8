"""What ``kvrouter bench`` decides before the fleet starts: workload, fleet, policies, rate.

:func:`bench.commands.plan` builds a :class:`Plan` from the settings; the harness runs it and
the console prints it and records it in the result document (:meth:`Plan.meta`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from bench.capacity import Capacity, WorkloadShape
from bench.fleet import FleetConfig
from bench.workloads import Workload


@dataclass(frozen=True)
class Plan:
    """Everything decided before the fleet starts."""

    workload: Workload
    fleet: FleetConfig
    policies: tuple[str, ...]
    shape: WorkloadShape
    capacity: Capacity
    rate_rps: float
    load: float

    def meta(self) -> dict[str, Any]:
        return {
            "workload": {"name": self.workload.name, **self.workload.params},
            "requests": self.workload.requests,
            "fleet": {
                k: v
                for k, v in dataclasses.asdict(self.fleet).items()
                if k not in ("workdir", "vllm")
            },
            "vllm": None
            if self.fleet.vllm is None
            else {"binary": str(self.fleet.vllm.binary), "model": str(self.fleet.vllm.model)},
            "time_scale": self.fleet.time_scale,
            "shape": dataclasses.asdict(self.shape),
            "ideal_hit_rate": self.shape.ideal_hit_rate,
            "capacity": dataclasses.asdict(self.capacity),
            "rate_rps": self.rate_rps,
            "load": self.load,
            "policies_order": list(self.policies),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
