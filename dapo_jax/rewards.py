r"""Rewards (docs/dapo_spec.md sections 4 and 6): a reward fn run safely over a batch, plus the
soft overlong punishment. Host code on strings and numpy; no jax.

reward.fn names a scorer of `math_answers.REWARD_FNS` (math_dapo, the recipe's; math_verify;
last_number), or a reward plug-in (`reward.fn = "module:function"` or
`"path/to/file.py:function"`, `RewardPlugin`): a user's function fn(response, ground_truth, *,
data_source, extra_info) returning a float score (acc = score > 0, pred "") or a dict with
"score" and optionally "acc" and "pred".

R_i = score_i + overlong_penalty(|o_i|) (soft overlong punishment, section 4).
`RewardScorer` runs a reward fn in worker processes with a per-call timeout: a fn that raises or
hangs costs one wrong answer, one count and at most one log line, never the run.
"""

import collections
import importlib
import importlib.util
import logging
import multiprocessing
import multiprocessing.connection
import os
import re
import time

import numpy as np

from dapo_jax.math_answers import REWARD_FNS, TAIL_CHARS, import_math_verify

ERROR = "[ERROR]"  # the reward fn raised, returned garbage, or killed its worker
TIMEOUT = "[TIMEOUT]"  # the reward fn ran past its time limit


class RewardPlugin:
    """A user's reward fn named `module:function` or `path/to/file.py:function`, loaded where it
    is called: pickled by its spec, so that spawned reward workers import it themselves and it
    runs under their timeout and error accounting. `__init__` loads it once, so that a bad spec
    fails at config-check time (ValueError, one line naming the spec and what is missing)."""

    takes_context = True  # RewardScorer passes data_source and extra_info

    def __init__(self, spec: str):
        source, _, self.function = spec.rpartition(":")
        if not source or not self.function:
            raise ValueError(
                f"reward.fn {spec!r}: expected a registry name {sorted(REWARD_FNS)}, "
                "'module:function' or 'path/to/file.py:function'"
            )
        self.source = os.path.abspath(source) if source.endswith(".py") else source
        self.spec = spec
        self._fn = None
        self._load()

    def __getstate__(self):
        return {**self.__dict__, "_fn": None}

    def _load(self):
        if self._fn is None:
            module = _import_source(self.source, self.spec)
            fn = getattr(module, self.function, None)
            if not callable(fn):
                names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
                raise ValueError(
                    f"reward.fn {self.spec!r}: {self.source} has no function "
                    f"{self.function!r}; it defines {names}"
                )
            self._fn = fn
        return self._fn

    def __call__(self, response: str, ground_truth: str, data_source: str = "", extra_info=None) -> dict:
        result = self._load()(response, ground_truth, data_source=data_source, extra_info=extra_info)
        if isinstance(result, (int, float)) and not isinstance(result, bool):
            return {"score": float(result), "acc": result > 0, "pred": ""}
        if isinstance(result, dict) and "score" in result:
            score = float(result["score"])
            return {
                "score": score,
                "acc": bool(result.get("acc", score > 0)),
                "pred": str(result.get("pred", "")),
            }
        raise TypeError(
            f"{self.spec} returned {result!r}: return a float or a dict with "
            "'score' (and optionally 'acc', 'pred')"
        )


def _import_source(source: str, spec: str):
    """The module of a plug-in spec: a .py file by path, else a module by its dotted name."""
    try:
        if source.endswith(".py"):
            if not os.path.isfile(source):
                raise ValueError(f"reward.fn {spec!r}: file {source} does not exist")
            name = "dapo_reward_plugin_" + re.sub(r"\W", "_", source)
            module_spec = importlib.util.spec_from_file_location(name, source)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            return module
        return importlib.import_module(source)
    except ModuleNotFoundError as e:
        raise ValueError(
            f"reward.fn {spec!r}: no module named {e.name!r} (put it on "
            "PYTHONPATH, or name a file: path/to/file.py:function)"
        ) from None
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the user's module raises on import
        raise ValueError(f"reward.fn {spec!r}: importing {source} raised {type(e).__name__}: {e}") from None


def get_reward_fn(name: str):
    """The reward fn registered as `name`, or a `RewardPlugin` for a "module:function" or
    "file.py:function" spec; checks an optional dependency or the plug-in now, not mid-run."""
    if ":" in name:
        return RewardPlugin(name)
    if name not in REWARD_FNS:
        raise ValueError(
            f"unknown reward fn {name!r}; valid names: {sorted(REWARD_FNS)}, or "
            "'module:function', or 'path/to/file.py:function'"
        )
    if name == "math_verify":
        import_math_verify()
    return REWARD_FNS[name]


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float = 1.0) -> float:
    """Soft overlong punishment (docs/dapo_spec.md section 4); lengths in tokens, L = |o_i| including EOS.

    expected = L_max - L_buf;  penalty = min(-(L - expected) / L_buf * factor, 0).
    """
    return float(overlong_penalties([length], max_len, buffer_len, factor)[0])


def overlong_penalties(
    lengths_B, max_len: int, buffer_len: int, factor: float = 1.0, enabled: bool = True
) -> np.ndarray:
    """`overlong_penalty` over a batch of lengths (float64); all zeros when not `enabled`."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len, got buffer_len={buffer_len}, max_len={max_len}")
    lengths_B = np.asarray(lengths_B, np.float64)
    if not enabled:
        return np.zeros_like(lengths_B)
    expected = max_len - buffer_len
    return np.minimum(-(lengths_B - expected) / buffer_len * factor, 0.0) + 0.0  # no -0.0


def overlong_filter_mask(truncated_B, enabled: bool = True) -> np.ndarray:
    """Overlong filtering (docs/dapo_spec.md section 4): per-response keep mask, False where truncated.

    Truncated = no EOS within L_max. All True when not `enabled`. The trainer applies it to the
    token mask: mask_BxT & keep_B[:, None].
    """
    truncated_B = np.asarray(truncated_B, bool)
    return ~truncated_B if enabled else np.ones_like(truncated_B)


def _worker_loop(conn, reward_fn):
    """Worker process: says it is ready, then for each list of (response, ground truth, context)
    sent to it sends one result per item as soon as it has it, until it receives None or its
    parent is gone. A non-empty context (data_source, extra_info) goes in as keywords."""
    conn.send(("ready", None))
    while (chunk := _receive_or_none(conn)) is not None:
        for response, ground_truth, context in chunk:
            try:
                conn.send(("ok", reward_fn(response, ground_truth, **context)))
            except Exception as e:  # pylint: disable=broad-except
                conn.send(("error", f"{type(e).__name__}: {e}"))


def _receive_or_none(conn):
    try:
        return conn.recv()
    except EOFError:  # the parent closed its end or exited
        return None


class _Worker:
    """One spawned worker process, the parent's end of its pipe, whether it said ready, and the
    chunk it is working on: item indices, position of the next result, when that item began."""

    def __init__(self, reward_fn):
        context = multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=_worker_loop, args=(child_conn, reward_fn), daemon=True)
        self.process.start()
        child_conn.close()
        self.ready = False
        self.chunk, self.position, self.item_start = [], 0, 0.0

    @property
    def busy(self) -> bool:
        return self.position < len(self.chunk)

    def take(self, chunk: list, items: list):
        self.conn.send(items)
        self.chunk, self.position, self.item_start = chunk, 0, time.monotonic()

    def stop(self, kill: bool):
        if not kill:
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.process.join(timeout=1.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class RewardScorer:
    """Scores responses with `reward_fn` in persistent worker processes.

    Each worker gets a chunk of up to `chunk_size` items and streams back one result per item.
    A call that raises, returns a malformed result or kills its worker is scored wrong with pred
    ERROR; one still running `timeout_s` seconds after its worker began it is scored wrong with
    pred TIMEOUT, its worker is killed and replaced, and the rest of its chunk is requeued. Each
    kind of failure is logged once per scorer with the offending text; every one is counted.
    `reward_fn` must be a picklable top-level function: workers are spawned, not forked (the
    parent runs jax threads). Use as a context manager, or call `close()`.
    """

    def __init__(
        self,
        reward_fn,
        timeout_s: float = 10.0,
        num_workers: int = 2,
        chunk_size: int = 64,
        startup_timeout_s: float = 120.0,
    ):
        if timeout_s <= 0 or num_workers < 1 or chunk_size < 1:
            raise ValueError(
                f"need timeout_s > 0, num_workers >= 1, chunk_size >= 1; got "
                f"{timeout_s}, {num_workers}, {chunk_size}"
            )
        self._reward_fn, self._timeout_s = reward_fn, timeout_s
        self._chunk_size, self._startup_timeout_s = chunk_size, startup_timeout_s
        self._workers = [_Worker(reward_fn) for _ in range(num_workers)]
        self._logged_kinds = set()
        self.totals = {"n_error": 0, "n_timeout": 0}  # over the scorer's life
        self._items = self._results = self._stats = self._todo = None  # of the batch in hand

    def score_batch(self, responses, ground_truths, contexts=None) -> tuple[list[dict], dict]:
        """Returns (one {"score", "acc", "pred"} per response, {"n_error", "n_timeout"} counts).
        `contexts` (one {"data_source", "extra_info"} per response) reach a reward fn that
        `takes_context` (a plug-in); the built-ins take the response and ground truth alone."""
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        if contexts is None or not getattr(self._reward_fn, "takes_context", False):
            contexts = [{}] * len(responses)
        self._items = list(zip(responses, ground_truths, contexts))
        self._results = [None] * len(responses)
        self._stats = {"n_error": 0, "n_timeout": 0}
        self._todo = collections.deque(range(len(responses)))
        for slot, worker in enumerate(self._workers):
            if worker.busy:  # left over from a batch that was interrupted by an exception
                self._replace(slot)
        while self._todo or any(w.busy for w in self._workers):
            self._dispatch()
            busy = [w for w in self._workers if w.busy]
            if busy:
                deadline = min(w.item_start for w in busy) + self._timeout_s
            else:
                deadline = time.monotonic() + self._startup_timeout_s
            waiting = [w.conn for w in self._workers if w.busy or not w.ready]
            ready_conns = multiprocessing.connection.wait(
                waiting, timeout=max(deadline - time.monotonic(), 0.0)
            )
            if not busy and not ready_conns:
                raise RuntimeError(f"no reward worker started within {self._startup_timeout_s} s")
            for slot, worker in enumerate(self._workers):
                if worker.conn in ready_conns:
                    self._receive(slot)
            now = time.monotonic()
            for slot, worker in enumerate(self._workers):
                if worker.busy and now - worker.item_start >= self._timeout_s:
                    self._fail_current(slot, "timeout", f"no result after {self._timeout_s} s")
        results, stats = self._results, self._stats
        for key, count in stats.items():
            self.totals[key] += count
        self._items = self._results = self._stats = self._todo = None
        return results, stats

    def _dispatch(self):
        """Hands a chunk of the queued items to every ready, idle worker."""
        for slot, worker in enumerate(self._workers):
            if worker.ready and not worker.busy and self._todo:
                size = min(self._chunk_size, -(-len(self._todo) // len(self._workers)))
                chunk = [self._todo.popleft() for _ in range(size)]
                try:
                    worker.take(chunk, [self._items[i] for i in chunk])
                except OSError:  # the worker died while idle: requeue for its replacement
                    self._todo.extendleft(reversed(chunk))
                    self._replace(slot)

    def _receive(self, slot):
        """Reads every message waiting from one worker."""
        worker = self._workers[slot]
        while True:
            try:
                status, payload = worker.conn.recv()
            except (EOFError, OSError):
                if not worker.ready:
                    raise RuntimeError(
                        "a reward worker died on start; reward_fn must be a "
                        "top-level function importable in a fresh process"
                    ) from None
                self._fail_current(slot, "error", "its worker process died")
                return
            if status == "ready":
                worker.ready = True
                return
            i = worker.chunk[worker.position]
            self._results[i] = self._checked(status, payload, *self._items[i])
            worker.position, worker.item_start = worker.position + 1, time.monotonic()
            if not worker.busy or not worker.conn.poll():
                return

    def _fail_current(self, slot, kind, detail):
        """Scores the worker's current item as failed, requeues the rest, replaces the worker."""
        worker = self._workers[slot]
        i = worker.chunk[worker.position]
        self._results[i] = self._failure(kind, detail, *self._items[i])
        self._todo.extendleft(reversed(worker.chunk[worker.position + 1 :]))
        self._replace(slot)

    def _checked(self, status, payload, response, ground_truth, _context) -> dict:
        if status == "ok":
            try:
                return {
                    "score": float(payload["score"]),
                    "acc": bool(payload["acc"]),
                    "pred": str(payload["pred"]),
                }
            except (TypeError, KeyError, ValueError) as e:
                payload = f"malformed result {payload!r} ({type(e).__name__}: {e})"
        return self._failure("error", payload, response, ground_truth)

    def _failure(self, kind, detail, response, ground_truth, _context=None) -> dict:
        self._stats[f"n_{kind}"] += 1
        if kind not in self._logged_kinds:
            self._logged_kinds.add(kind)
            logging.warning(
                "reward fn %s: %s (logged once; later ones are only counted). "
                "Response tail %r, ground truth %r",
                kind,
                detail,
                response[-TAIL_CHARS:],
                ground_truth,
            )
        return {"score": -1.0, "acc": False, "pred": TIMEOUT if kind == "timeout" else ERROR}

    def _replace(self, slot):
        self._workers[slot].stop(kill=True)
        self._workers[slot] = _Worker(self._reward_fn)

    def close(self):
        for worker in self._workers:
            worker.stop(kill=False)
        self._workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def score_batch(
    reward_fn, responses, ground_truths, timeout_s: float = 10.0, num_workers: int = 2
) -> tuple[list[dict], dict]:
    """One-off `RewardScorer(reward_fn, timeout_s, num_workers).score_batch(...)`."""
    with RewardScorer(reward_fn, timeout_s, num_workers) as scorer:
        return scorer.score_batch(responses, ground_truths)
