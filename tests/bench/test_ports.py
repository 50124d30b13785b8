"""Loopback ports handed to processes that bind them later."""

from __future__ import annotations

import socket

import pytest

from bench.stack import ports
from bench.stack.ports import _ephemeral_ports, free_port, free_ports, share_ports


def test_free_ports_are_bindable_and_outside_the_ephemeral_range() -> None:
    """An outgoing connection may take an ephemeral port before its process binds it."""
    low, high = _ephemeral_ports()
    for _ in range(50):
        port = free_port()
        assert not low <= port <= high, port
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_run_of_free_ports_fits_below_the_last_port() -> None:
    for _ in range(50):
        first = free_ports(8)
        assert first + 8 <= 65_536
        socks = [socket.socket() for _ in range(8)]
        try:
            for offset, sock in enumerate(socks):
                sock.bind(("127.0.0.1", first + offset))
        finally:
            for sock in socks:
                sock.close()


def test_no_port_is_handed_out_twice_before_its_process_binds_it() -> None:
    """A router's port picked first must not be picked again for the engines started next."""
    handed: list[int] = []
    for _ in range(200):
        first = free_ports(3)
        handed.extend(range(first, first + 3))
        handed.append(free_port())
    assert len(set(handed)) == len(handed)


def test_processes_sharing_the_range_pick_from_their_own_parts() -> None:
    before = ports._share
    try:
        picked = []
        for which in range(3):
            share_ports(which, 3)
            picked.append([free_ports(2) for _ in range(20)])
    finally:
        share_ports(*before)
    assert max(picked[0]) + 1 < min(picked[1])  # a run of two stays inside its part
    assert max(picked[1]) + 1 < min(picked[2])
    with pytest.raises(ValueError):
        share_ports(3, 3)
