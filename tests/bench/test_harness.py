"""The benchmark fleet's settings: what the routers are told about the simulated engines."""

from __future__ import annotations

import argparse

import pytest

from bench.fleet import FleetConfig, lone_prefill_speed
from bench.harness import POLICIES, POLICY_FLAGS
from bench.peers import PEERS
from publishers.config import EngineShape, ReplicaSettings, shape_fields
from publishers.sim.latency import load_profile
from router.baselines import BASELINES
from router.baselines import POLICIES as ROUTER_POLICIES
from router.decide.policy_types import DEFAULT_SPEED, PolicyConfig


def test_the_simulated_h200_prefills_at_the_calibrated_speed() -> None:
    speed = lone_prefill_speed(load_profile("llama-8b"), 8192)
    # the profile is fitted to the same H200 calibration as the router's default seed
    assert speed.prefill_ms_per_token == pytest.approx(DEFAULT_SPEED.prefill_ms_per_token, 0.05)
    assert 15 < speed.floor_ms < 35
    slower = lone_prefill_speed(load_profile("llama-8b"), 8192, time_scale=3.0)
    assert slower.prefill_ms_per_token == pytest.approx(3 * speed.prefill_ms_per_token)
    assert slower.floor_ms == pytest.approx(3 * speed.floor_ms)


def test_routers_are_seeded_for_the_time_scale_and_later_flags_win() -> None:
    args = FleetConfig(time_scale=3.0, router_args=("--prefill-ms-per-token", "1")).stack()
    flags = list(args.router_args)
    seeded = float(flags[flags.index("--prefill-ms-per-token") + 1])
    assert seeded == pytest.approx(3 * DEFAULT_SPEED.prefill_ms_per_token, 0.05)
    # the policy's other engine-time constants scale with the engines too
    policy = PolicyConfig()
    penalty = float(flags[flags.index("--kv-full-penalty-ms") + 1])
    assert penalty == pytest.approx(3 * policy.kv_full_penalty_ms)
    decode = float(flags[flags.index("--decode-ms-per-request") + 1])
    assert decode == pytest.approx(3 * policy.decode_ms_per_request)
    assert flags[-2:] == ["--prefill-ms-per-token", "1"]  # the user's, last: argparse keeps it


def test_the_arms_are_the_router_registry_and_the_peers() -> None:
    assert set(POLICY_FLAGS.values()) <= set(ROUTER_POLICIES)
    assert set(BASELINES) <= set(POLICY_FLAGS)  # every baseline of the router is an arm
    assert POLICY_FLAGS["kvrouter"] == "ttft"
    in_router = ("round-robin", "least-load", "seed", "sglang", "kvrouter", "oracle")
    assert (*in_router, *PEERS) == POLICIES


def test_the_engine_shape_reaches_the_replicas_as_their_own_flags() -> None:
    stack = FleetConfig(num_blocks=512, time_scale=3.0, floor_ms=2.5).stack()
    parser = argparse.ArgumentParser()
    ReplicaSettings.add_arguments(parser)
    replica = ReplicaSettings.from_args(parser.parse_args(list(stack.replica_flags())), {})
    assert shape_fields(replica) == shape_fields(stack)
    assert stack.num_blocks == 512 and stack.floor_ms == 2.5
    # one declaration of the defaults: the replica's settings take the shape's
    assert shape_fields(ReplicaSettings()) == shape_fields(EngineShape())
