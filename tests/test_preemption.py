"""Preemption (a SIGTERM seen by a watcher thread, passed on through the coordination service's
key-value store), the wall-clock checkpoint cadence and the message of a failed collective,
without a second process (tests/test_pod.py runs four real ones)."""

import os
import signal
import threading
import time
import types

import pytest
from jax._src import distributed

from dapo_jax import hosts, preemption


@pytest.fixture
def two_processes(monkeypatch):
    monkeypatch.setattr(hosts.jax, "process_count", lambda: 2)
    monkeypatch.setattr(hosts.jax, "process_index", lambda: 0)


class _Store:
    """The coordination service's key-value store, as the jax.distributed client sees it."""

    def __init__(self):
        self.kv = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        if key in self.kv and not allow_overwrite:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.kv[key] = value

    def key_value_try_get(self, key):
        if key not in self.kv:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.kv[key]

    def blocking_key_value_get(self, key, timeout_in_ms):
        deadline = time.monotonic() + timeout_in_ms / 1000
        while key not in self.kv:
            if time.monotonic() > deadline:
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            time.sleep(0.01)
        return self.kv[key]


@pytest.fixture
def exits(monkeypatch):
    """os._exit recorded (with the time) instead of done; the watcher thread then goes on."""
    done = []
    monkeypatch.setattr(preemption.os, "_exit", lambda code: done.append((code, time.monotonic())))
    return done


def _wait(condition, seconds=10):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_sigterm_stops_a_busy_process_within_a_second(exits, capsys):
    """The main thread is busy (in a lock wait, as in a long XLA program); the watcher sees the
    signal all the same, runs the before-exit callables and exits 75."""
    saved = []
    p = preemption.Preemption([lambda: saved.append(1)], poll_s=0.05)
    try:
        t0 = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(1.0)
        _wait(lambda: exits)
        assert exits and exits[0][0] == preemption.PREEMPTED == 75 and exits[0][1] - t0 < 1.0
        assert saved == [1] and preemption.noticed()
    finally:
        p.close()
    assert not preemption.noticed() and signal.getsignal(signal.SIGTERM) is not None
    assert "preempted: process 0 got SIGTERM" in capsys.readouterr().err


def test_a_sigterm_on_another_process_stops_this_one(exits, monkeypatch, capsys):
    """Process 1 of 2: process 0 posted the notice and its word; this one stops, posts its own
    word and exits 75; a slow before-exit callable is left behind at the grace time."""
    store = _Store()
    monkeypatch.setattr(distributed.global_state, "process_id", 1)
    monkeypatch.setattr(distributed.global_state, "num_processes", 2)
    monkeypatch.setattr(distributed.global_state, "client", store)
    p = preemption.Preemption([lambda: time.sleep(30)], grace_s=0.5, poll_s=0.05)
    try:
        time.sleep(0.2)
        assert not exits
        store.key_value_set("dapo_jax/preempted", "process 0 got SIGTERM")
        store.key_value_set("dapo_jax/preempted/noticed/0", "1")
        _wait(lambda: exits)
        assert [code for code, _ in exits] == [75]
        assert store.kv["dapo_jax/preempted/noticed/1"] == "1"
    finally:
        p.close()
    assert "preempted: process 0 got SIGTERM; every process stops now" in capsys.readouterr().err


def test_the_wall_clock_cadence(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(preemption.time, "monotonic", lambda: now[0])
    clock = preemption.ClockCadence(every_minutes=2)
    now[0] += 119
    assert not clock.due()
    now[0] += 1
    assert clock.due()
    clock.saved()
    assert not clock.due()
    assert not preemption.ClockCadence(None).due()


class _Exit(Exception):
    pass


def _exit(code):
    raise _Exit(code)


def test_a_failed_collective_names_the_dead_process(two_processes, monkeypatch, capsys):
    client = types.SimpleNamespace(get_live_nodes=lambda ids: {0: 123})  # 1 stopped beating
    monkeypatch.setattr(distributed.global_state, "client", client)
    monkeypatch.setattr(hosts.os, "_exit", _exit)
    closed = []
    run = types.SimpleNamespace(scorer=types.SimpleNamespace(close=lambda: closed.append(1)))
    with pytest.raises(_Exit, match="1"):
        hosts.peer_failure(RuntimeError("Gloo AllGather failed: Connection reset by peer"), run.scorer.close)
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

    monkeypatch.setattr(hosts.jax, "process_index", lambda: 1)
    monkeypatch.setattr(distributed.global_state, "client", types.SimpleNamespace(get_live_nodes=unreachable))
    monkeypatch.setattr(hosts.os, "_exit", _exit)
    run = types.SimpleNamespace(scorer=types.SimpleNamespace(close=lambda: None))
    with pytest.raises(_Exit):
        hosts.peer_failure(RuntimeError("Connection closed by peer"), run.scorer.close)
    assert "process 0 died" in capsys.readouterr().err.splitlines()[-1]
