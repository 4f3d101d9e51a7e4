"""The hosts' agreement on preemption and the message of a failed collective, without a second
process (tests/test_multiprocess.py runs the real two-process cases)."""

import signal
import types

import numpy as np
import pytest
from jax._src import distributed

from dapo_jax import train


@pytest.fixture
def two_processes(monkeypatch):
    monkeypatch.setattr(train.jax, "process_count", lambda: 2)
    monkeypatch.setattr(train.jax, "process_index", lambda: 0)


def test_a_sigterm_seen_by_another_host_stops_this_one(two_processes, monkeypatch):
    old = signal.getsignal(signal.SIGTERM)
    try:
        p = train._Preemption()
        gathered = []

        def allgather(x):  # process 1 has had the signal, this one has not
            gathered.append(int(x))
            return np.array([int(x), 1])

        monkeypatch.setattr(train.multihost_utils, "process_allgather", allgather)
        assert p.agreed() and gathered == [0]
        monkeypatch.setattr(train.multihost_utils, "process_allgather", lambda x: np.array([int(x), 0]))
        assert not p.agreed()
        p._handle(signal.SIGTERM, None)
        assert p.agreed()
    finally:
        signal.signal(signal.SIGTERM, old)


class _Exit(Exception):
    pass


def _exit(code):
    raise _Exit(code)


def test_a_failed_collective_names_the_dead_process(two_processes, monkeypatch, capsys):
    client = types.SimpleNamespace(get_live_nodes=lambda ids: {0: 123})  # 1 stopped beating
    monkeypatch.setattr(distributed.global_state, "client", client)
    monkeypatch.setattr(train.os, "_exit", _exit)
    closed = []
    run = types.SimpleNamespace(scorer=types.SimpleNamespace(close=lambda: closed.append(1)))
    with pytest.raises(_Exit, match="1"):
        train._peer_failure(RuntimeError("Gloo AllGather failed: Connection reset by peer"), run)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(
        "error: process 0: a collective with the other processes failed "
        "(Gloo AllGather failed: Connection reset by peer)"
    )
    assert err[1].startswith("error: process 0: process(es) 1 of 2 stopped sending heartbeats")
    assert closed == [1]


def test_an_unreachable_coordinator_is_process_0(two_processes, monkeypatch, capsys):
    def unreachable(ids):
        raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service")

    monkeypatch.setattr(train.jax, "process_index", lambda: 1)
    monkeypatch.setattr(distributed.global_state, "client", types.SimpleNamespace(get_live_nodes=unreachable))
    monkeypatch.setattr(train.os, "_exit", _exit)
    run = types.SimpleNamespace(scorer=types.SimpleNamespace(close=lambda: None))
    with pytest.raises(_Exit):
        train._peer_failure(RuntimeError("Connection closed by peer"), run)
    assert "process 0 died" in capsys.readouterr().err.splitlines()[-1]
