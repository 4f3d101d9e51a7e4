"""Preemption: a SIGTERM to any process of a run stops every process within seconds, with exit
status 75 (`PREEMPTED`, EX_TEMPFAIL: requeue me), keeping the last complete checkpoint.

A Spot or preemptible TPU VM gets ~30 s between its SIGTERM and its end, and a 32B step takes
hours, so the step in flight is abandoned: the run resumes from its last checkpoint and computes
that step again, exactly (its PRNG key comes from the seed and the step, the data order and the
filter's carry from the checkpoint). Checkpoints come every `checkpoint.every` steps and every
`checkpoint.every_minutes` of wall clock (`ClockCadence`), so little is lost.

How every process learns of it, promptly and without a collective that could hang:
- `set_wakeup_fd`: the C-level signal handler writes the signal's number to a socket that a
  watcher thread selects on, so the notice is seen while the main thread is inside a
  minutes-long XLA program (a Python handler would run only when that program returns);
- the notice goes to JAX's coordination service (the key-value store of jax.distributed, on
  process 0), which every process's watcher polls every `poll_s`: one process's signal reaches
  all of them within a second. jax's own preemption service
  (`multihost_utils.reached_preemption_sync_point`, orbax's `reached_preemption`) agrees on a
  *step* to save at instead, which needs every process to reach that point: hours away here;
- each process then waits (at most `grace_s` in all) for its checkpoint save in flight, sets an
  "I noticed" key and waits for everyone's, so that no process exits while another could still
  take the exit of a peer for a crash (`noticed()` tells `hosts.peer_failure` to wait instead);
  process 0, which serves the keys, exits last; then `os._exit(75)`, which also ends a main
  thread stuck in a collective with a peer that has already gone.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import jax
import numpy as np
from jax._src import distributed  # the client of jax.distributed.initialize: its key-value store
from jax.experimental import multihost_utils

PREEMPTED = 75  # exit status of a preempted run (EX_TEMPFAIL): restart it
_NOTICE = "dapo_jax/preempted"  # the coordination-service key of the first notice
_current: Preemption | None = None


def noticed() -> bool:
    """Whether this process is stopping for a preemption (its exit follows within seconds)."""
    return _current is not None and _current.stopping.is_set()


def _process() -> tuple[int, int]:
    """(this process's index, the process count) as jax.distributed.initialize set them, read
    without starting JAX's backends."""
    return distributed.global_state.process_id, distributed.global_state.num_processes


def _client():
    """The jax.distributed client (its key-value store), None in a one-process run."""
    return distributed.global_state.client if _process()[1] > 1 else None


class Preemption:
    """Watches for SIGTERM from construction to `close()`; see the module docstring. The
    callables in `before_exit` (a checkpoint save to finish) run before the exit, within
    `grace_s` seconds in all."""

    def __init__(self, before_exit: list[Callable[[], None]], grace_s: float = 20.0, poll_s: float = 0.5):
        global _current  # noqa: PLW0603 - one watcher per process, as there is one SIGTERM
        self._before_exit, self._grace_s, self._poll_s = before_exit, grace_s, poll_s
        self.stopping, self._closed = threading.Event(), threading.Event()
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._handler = signal.signal(signal.SIGTERM, lambda signum, frame: None)
        self._wakeup = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="preemption", daemon=True)
        self._thread.start()
        _current = self

    def close(self) -> None:
        """Stop watching (the run has ended); SIGTERM gets its former handler back."""
        global _current  # noqa: PLW0603
        self._closed.set()
        self._thread.join()
        signal.set_wakeup_fd(self._wakeup)
        signal.signal(signal.SIGTERM, self._handler)
        self._read.close()
        self._write.close()
        _current = None

    def _watch(self) -> None:
        client = _client()
        while not self._closed.is_set():
            if select.select([self._read], [], [], self._poll_s)[0]:
                if signal.SIGTERM in self._read.recv(64):
                    return self._stop(client, f"process {_process()[0]} got SIGTERM", announce=True)
            elif client is not None and _get(client, _NOTICE) is not None:
                return self._stop(client, _get(client, _NOTICE), announce=False)

    def _stop(self, client, why: str, announce: bool) -> None:
        self.stopping.set()
        if client is not None and announce:
            try:
                client.key_value_set(_NOTICE, why)
            except Exception:  # noqa: BLE001 - another process's notice came first: the same stop
                pass
        print(
            f"preempted: {why}; every process stops now, abandoning the step in flight: "
            f"relaunch to resume from the last checkpoint (exit status {PREEMPTED})",
            file=sys.stderr,
            flush=True,
        )
        deadline = time.monotonic() + self._grace_s
        for fn in self._before_exit:
            _bounded(fn, deadline)
        if client is not None:
            _rendezvous(client, deadline)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(PREEMPTED)


def _bounded(fn: Callable[[], None], deadline: float) -> None:
    """`fn()` in a thread, waited for until `deadline` at most (then left behind)."""
    worker = threading.Thread(target=fn, daemon=True)
    worker.start()
    worker.join(max(deadline - time.monotonic(), 0.0))


def _rendezvous(client, deadline: float) -> None:
    """Every process says it has noticed the preemption and waits (until `deadline` at most)
    for the others' word; process 0, whose coordination service the others' clients talk to,
    waits a little longer for their exits."""
    me, n = _process()
    client.key_value_set(f"{_NOTICE}/noticed/{me}", "1")
    for p in range(n):
        remaining_ms = int(max(deadline - time.monotonic(), 0.1) * 1000)
        try:
            client.blocking_key_value_get(f"{_NOTICE}/noticed/{p}", remaining_ms)
        except Exception:  # noqa: BLE001 - a dead or hung process: exit without its word
            return
    if me == 0:
        time.sleep(1.0)


def _get(client, key: str) -> str | None:
    """The value of `key` in the coordination service's store, None where it has none (or the
    service is gone: process 0 ended, which the heartbeat reports)."""
    try:
        return client.key_value_try_get(key)
    except Exception:  # noqa: BLE001 - NOT_FOUND, or an unreachable service
        return None


class ClockCadence:
    """Whether a checkpoint is due by the wall clock: `every_minutes` since the last save (None:
    never). Process 0's clock decides and its answer is broadcast, so that every process saves at
    the same step (the processes' clocks and step times differ)."""

    def __init__(self, every_minutes: float | None):
        self._every_s = None if every_minutes is None else every_minutes * 60.0
        self._last = time.monotonic()

    def due(self) -> bool:
        if self._every_s is None:
            return False
        mine = time.monotonic() - self._last >= self._every_s
        if jax.process_count() == 1:
            return mine
        return bool(multihost_utils.broadcast_one_to_all(np.int32(mine)))

    def saved(self) -> None:
        self._last = time.monotonic()
