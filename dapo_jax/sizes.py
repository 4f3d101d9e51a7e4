"""Row counts against the mesh, in one place: which sizes are padded and which are checked.

A batch axis of d devices (the mesh's data x fsdp axes; the sampler's data axis, as wide) holds
a number of rows that is a multiple of d. Two cases:

- Padded, exactly. The sampler's rows are independent of one another (each row's samples
  depend on its prompt and key alone), so any number of prompts P and responses n works: the
  prompts are filled up to the next multiple of d (`padded_count`) with copies of the last
  one (`pad_rows`), whose rows are dropped before any score, metric or loss sees them. This
  covers every generation batch (`filter.gen_batch_prompts` x `rollout.group_size`), every
  evaluation (`eval.samples`, `eval.batch_prompts`, `eval.max_problems`, any number of
  problems) and the engine's calls (`engine_plan`).
- Checked before anything compiles. The trainer's batch is cut into mini-batches of prompts
  and micro-batches of rows by the config; a row count that does not split over the devices
  would need empty rows trained on in every update (or a different split), where the nearest
  sizes that fit cost nothing. `check_batch_sizes` names the key, its value, the device count
  and the nearest values that work, in one line (`ConfigError`). The log-prob pass runs on the
  train batch, so the same checks cover it. A sampler's `decode_slots` (the engine's rows decoded
  at once) is checked the same way (`check_decode_slots`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from dapo_jax.errors import ConfigError
from dapo_jax.sharding import mesh_shape


class BatchAxes(NamedTuple):
    """How many devices split a batch's rows: d, the trainer mesh's data x fsdp, and the sampler
    mesh's data axis (the trainer's devices over its tensor axis)."""

    devices: int  # all devices of the run
    rows: int  # d


def padded_count(count: int, devices: int) -> int:
    """The smallest multiple of `devices` at least `count`: prompts that split over the sampler's
    data x fsdp shards, each shard decoding its own prompts' rows."""
    return -(-count // devices) * devices


def pad_rows(x, count: int) -> np.ndarray:
    """`x` (rows first) filled up to `count` rows with copies of its last row."""
    x = np.asarray(x)
    return np.concatenate([x, np.repeat(x[-1:], count - len(x), axis=0)]) if count > len(x) else x


def nearest(value: int, works: Callable[[int], bool], upper: int) -> tuple[int, ...]:
    """The values in [1, `upper`] closest to `value` below and above it for which `works` holds."""
    below = next((v for v in range(min(value - 1, upper), 0, -1) if works(v)), None)
    above = next((v for v in range(value + 1, upper + 1) if works(v)), None)
    return tuple(v for v in (below, above) if v is not None)


def listed(values: list[int]) -> str:
    """ "2, 4 or 8"."""
    return ", ".join(map(str, values[:-1])) + f" or {values[-1]}" if len(values) > 1 else str(values[0])


def _error(key: str, value: int, why: str, works: Callable[[int], bool], upper: int) -> ConfigError:
    """`key value: why; nearest values that work: a and b` as a ConfigError."""
    near = nearest(value, works, upper)
    that = "values that work" if len(near) > 1 else "value that works"
    return ConfigError(f"{key} {value}: {why}; nearest {that}: {' and '.join(map(str, near))}")


def batch_axes(mesh: Mapping[str, int], devices: int) -> BatchAxes:
    """d of a run on `devices` devices with mesh sizes `mesh` (one may be -1); a ConfigError
    when the mesh does not fit the devices."""
    try:
        data, fsdp, tensor = mesh_shape(mesh, devices)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return BatchAxes(devices, data * fsdp)


def check_decode_slots(slots: int | None, devices: int) -> None:
    """A sampler's `decode_slots` S (None: every row) splits over its `devices` data shards."""
    if slots and slots % devices:
        raise _error(
            "decode_slots",
            slots,
            f"the engine's slots split over the {devices} devices of the sampler mesh's data x fsdp axes",
            lambda v: v % devices == 0,
            slots + devices,
        )


def check_train_sizes(train_prompts: int, mini_prompts: int, micro_rows: int, group_size: int, devices: int):
    """The train batch of `train_prompts` prompts x G rows splits into mini-batches of
    `mini_prompts` prompts x G rows, each over the d_t = `devices` devices, and into
    micro-batches of `micro_rows` rows, a multiple of d_t (each device holds whole rows of
    every micro-batch)."""
    g, d = group_size, devices
    over = f"the {d} devices of the mesh's data x fsdp axes"
    if (train_prompts * g) % d:
        raise _error(
            "train.train_batch_prompts",
            train_prompts,
            f"{train_prompts} prompts x G={g} = {train_prompts * g} rows do not split over {over}",
            lambda v: (v * g) % d == 0,
            train_prompts + d,
        )
    mini_ok = lambda v: train_prompts % v == 0 and (v * g) % d == 0
    if not mini_ok(mini_prompts):
        minis = [v for v in range(1, train_prompts + 1) if mini_ok(v)]
        raise _error(
            "train.mini_batch_prompts",
            mini_prompts,
            f"a train batch of {train_prompts} prompts splits into mini-batches of {listed(minis)} "
            f"prompts, whose rows (x G={g}) split over {over}",
            mini_ok,
            train_prompts,
        )
    rows = mini_prompts * g
    micro_ok = lambda v: rows % v == 0 and v % d == 0
    if not micro_ok(micro_rows):
        micros = [v for v in range(1, rows + 1) if micro_ok(v)]
        raise _error(
            "train.micro_batch_size",
            micro_rows,
            f"a mini-batch of {mini_prompts} prompts x G={g} = {rows} rows splits into micro-batches "
            f"of {listed(micros)} rows, each split over {over}",
            micro_ok,
            rows,
        )


def check_batch_sizes(c, devices: int) -> BatchAxes:
    """The config's batch sizes against `devices` devices (module docstring): its BatchAxes, or
    a one-line ConfigError naming the first key that does not fit."""
    axes = batch_axes(c.mesh, devices)
    t = c.train
    check_train_sizes(
        t.train_batch_prompts, t.mini_batch_prompts, t.micro_batch_size, c.rollout.group_size, axes.rows
    )
    return axes
