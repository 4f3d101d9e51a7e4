"""The chips of a TPU slice (HBM, bf16 peak, HBM bandwidth) and the abstract devices of a
topology name (`jax.experimental.topologies`, which needs libtpu), for compiling ahead of time
(`dapo_jax.aot`); `cpu:N` names N host devices instead."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import numpy as np

from dapo_jax.errors import ConfigError


class Chip(NamedTuple):
    hbm_gib: float
    peak_tflops: float  # bf16
    hbm_gbps: float


CHIPS = {
    "v5p": Chip(95, 459, 2765),
    "v6e": Chip(32, 918, 1640),
    "v5e": Chip(16, 197, 819),
    "cpu": Chip(16, 1, 50),
}


def topology_devices(name: str):
    """`(chip kind, devices)` of a topology name: v5p-N counts TensorCores (2 per chip) as
    Cloud TPU names slices, v6e-N and v5e-N count chips; cpu:N takes N host devices."""
    kind, _, size = name.replace(":", "-").partition("-")
    if kind not in CHIPS or not size.isdigit() or int(size) < 1:
        raise ConfigError(f"--topology {name!r} is not v5p-N, v6e-N, v5e-N or cpu:N")
    n = int(size)
    if kind == "cpu":
        devices = jax.devices("cpu")
        if len(devices) < n:
            raise ConfigError(
                f"--topology {name}: {len(devices)} host devices; run with "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={n}"
            )
        return kind, devices[:n]
    chips = n // 2 if kind == "v5p" else n
    shape = _torus(chips, 3 if kind == "v5p" else 2, name)
    from jax.experimental import topologies  # noqa: PLC0415 - needs libtpu only here

    try:
        topo = topologies.get_topology_desc(
            platform="tpu",
            topology_name=f"{kind}:{'x'.join(map(str, shape))}",
            chip_config_name="default",
            chips_per_host_bounds=(2, 2, 1),
            num_slices=1,
        )
    except Exception as e:  # noqa: BLE001 - no libtpu, or a shape libtpu does not know
        raise ConfigError(
            f"--topology {name}: no abstract TPU devices ({type(e).__name__}: "
            f"{str(e)[:160]}); install the tpu extra (jax[tpu]) or use "
            "cpu:N"
        ) from None
    return kind, topo.devices


def _torus(chips: int, dims: int, name: str) -> tuple[int, ...]:
    """The slice shape of `chips` chips: from 2x2(x1), the smallest axis doubled until full."""
    if chips < 4 or chips & (chips - 1):
        raise ConfigError(f"--topology {name}: {chips} chips; use a power of two >= 4 chips")
    shape = [2, 2] + [1] * (dims - 2)
    while math.prod(shape) < chips:
        i = len(shape) - 1 - int(np.argmin(shape[::-1]))
        shape[i] *= 2
    return tuple(sorted(shape))
