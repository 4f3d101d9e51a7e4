"""What the processes of a multi-host run share on the host side: the reward scoring split over
them, and the checks that they still agree on what decides their next collective.

Rewards (docs/dapo_spec.md section 4) are host code: every process decodes the whole generation
batch (its all-gathered tokens), but with n processes process i scores only its own contiguous
1/n of the B rows (`rows_of`), and the results are all-gathered, so each row is scored once,
every process holds the same R_i, acc_i and pred_i, and each spends 1/n of the CPU. The
dynamic-sampling filter then runs on every process on identical inputs; `check_agreed` compares
a digest of what the filter decided (the kept mask, the generation-batch count) across processes
after each generation batch, so that processes that would go on to different collectives (one
more generation batch on one of them: a hang no heartbeat sees) stop instead, each with the
same one-line `HostDisagreement`. rewards.py and the filter stay JAX-free: the gathering is here.
When a collective fails because a process died, `peer_failure` names the dead one.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import zlib

import jax
import numpy as np
from jax._src import distributed  # the client of jax.distributed.initialize
from jax.experimental import multihost_utils

from dapo_jax import preemption
from dapo_jax.errors import HostDisagreement


def rows_of(num_rows: int, process: int, num_processes: int) -> slice:
    """The contiguous rows that `process` scores: np.array_split's share (the first
    num_rows % n processes get one row more)."""
    base, extra = divmod(num_rows, num_processes)
    start = process * base + min(process, extra)
    return slice(start, start + base + (process < extra))


def allgather_json(value) -> list:
    """Every process's JSON-able `value`, in process order (one list, the same on every process):
    two all-gathers, the lengths and then the UTF-8 bytes padded to the longest."""
    if jax.process_count() == 1:
        return [json.loads(json.dumps(value))]
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.int32(data.size))).reshape(-1)
    padded = np.zeros(max(int(lengths.max()), 1), np.uint8)
    padded[: data.size] = data
    gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [json.loads(row[:n].tobytes()) for row, n in zip(gathered, lengths)]


class SplitScorer:
    """A `rewards.RewardScorer` whose rows are split over the processes (`rows_of`) and whose
    results are all-gathered: the scorer's interface (score_batch, totals, close), the same
    results on every process. `totals` counts the failures of every process's rows. One process:
    the scorer itself, nothing gathered."""

    def __init__(self, scorer):
        self._scorer = scorer
        self.totals = {"n_error": 0, "n_timeout": 0}

    def score_batch(self, responses, ground_truths, contexts=None) -> tuple[list[dict], dict]:
        n = jax.process_count()
        if n == 1:
            results, stats = self._scorer.score_batch(responses, ground_truths, contexts)
        else:
            mine = rows_of(len(responses), jax.process_index(), n)
            own = self._scorer.score_batch(
                responses[mine], ground_truths[mine], contexts[mine] if contexts is not None else None
            )
            gathered = allgather_json(own)
            results = [r for rows, _ in gathered for r in rows]
            stats = {k: sum(s[k] for _, s in gathered) for k in self.totals}
        for key in self.totals:
            self.totals[key] += stats[key]
        return results, stats

    def close(self) -> None:
        self._scorer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def digest(x) -> int:
    """A 31-bit CRC of an array's dtype, shape and bytes (the same value on every process)."""
    a = np.ascontiguousarray(np.asarray(x))
    return zlib.crc32(a.tobytes(), zlib.crc32(f"{a.dtype.str}{a.shape}".encode())) & 0x7FFFFFFF


def check_agreed(where: str, values: dict) -> None:
    """Raise the same `HostDisagreement` on every process when the processes hold different
    `values` (name -> array or number) at `where`; one all-gather of their digests. Every
    process must call it at the same point (before any collective that depends on `values`)."""
    if jax.process_count() == 1:
        return
    names = list(values)
    mine = np.asarray([digest(values[k]) for k in names], np.int32)
    all_PxK = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, len(names))
    odd = {k: _minority(all_PxK[:, j]) for j, k in enumerate(names)}
    differ = {k: p for k, p in odd.items() if p}
    if differ:
        raise HostDisagreement(
            f"{where}: the processes disagree on "
            + "; ".join(f"the {k} (processes {', '.join(map(str, p))} differ)" for k, p in differ.items())
            + ": a reward fn or filter not deterministic across hosts, or hosts with different "
            "code or data; stopped before they run different collectives"
        )


def _minority(digests_P: np.ndarray) -> list[int]:
    """The processes whose digest is not the most common one (ties: process 0's wins)."""
    values, counts = np.unique(digests_P, return_counts=True)
    common = max(values, key=lambda v: (counts[values == v][0], v == digests_P[0]))
    return [int(p) for p in np.flatnonzero(digests_P != common)]


def peer_failure(error: Exception, close_workers) -> None:
    """A collective of a multi-process run failed: most likely another process died. Says so,
    waits for JAX's coordination service to name the dead process(es) (it declares a process
    dead after --heartbeat_timeout seconds without a heartbeat, and may itself end this process
    first with "The following tasks are unhealthy ... : N"), closes this process's reward
    workers (`close_workers()`), then exits with status 1 without running the shutdown barrier
    that would wait for the dead one."""
    me, n = jax.process_index(), jax.process_count()
    if preemption.noticed():  # a peer has left for the preemption: this process's exit follows
        threading.Event().wait()
    reason = " ".join(str(error).split())[:300]
    print(
        f"error: process {me}: a collective with the other processes failed ({reason}); "
        f"waiting up to --heartbeat_timeout for the coordination service to name the dead "
        "process",
        file=sys.stderr,
        flush=True,
    )
    try:
        close_workers()  # the reward workers
    except Exception:  # noqa: BLE001 - exiting anyway; the reward workers end with this process
        pass
    try:
        alive = distributed.global_state.client.get_live_nodes(list(range(n)))
        dead = sorted(set(range(n)) - set(alive))
        print(
            f"error: process {me}: process(es) {', '.join(map(str, dead)) or 'none'} of {n} "
            "stopped sending heartbeats (died); relaunch all processes: the run resumes from "
            "the last complete checkpoint",
            file=sys.stderr,
            flush=True,
        )
    except Exception as e:  # noqa: BLE001 - the service itself may be gone (process 0 died)
        print(
            f"error: process {me}: the coordination service (process 0) is unreachable "
            f"({type(e).__name__}): process 0 died; relaunch all processes",
            file=sys.stderr,
            flush=True,
        )
    os._exit(1)
