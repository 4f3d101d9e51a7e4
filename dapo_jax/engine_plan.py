"""The engine's sizes from the chip's memory, so that no config sets them: a data shard's S slots
(rows decoded at once) and P_c, the prompts of one call.

A data shard's engine holds a pool of M = P_c x J + S x (I + 1) pages (`engine.geometry`: the
call's prompts' pages, J each, for the whole call, and every slot's I pages at N new tokens with a
spare), each page b = Z x 2K x E x L x itemsize bytes, its kv heads split over the tensor axis.
Beside it stays what the run keeps resident on a chip, R (the train state, the samplers' weights,
the reference's). Of the chip's H bytes a share HEADROOM is left for the programs' temporaries:

- S is the largest power of two, at most the call's rows and, where the Pallas kernel runs, the
  rows whose page tables its scalar memory holds (`paged_attention.kernel_max_rows`), with
  R + b x (J + S x (I + 1)) within (1 - HEADROOM) x H: the slots first, since a step's cost is
  mostly the weights' bytes, whatever S;
- P_c is the largest divisor of the shard's P prompts (calls of equal size) with
  R + b x (P_c x J + S x (I + 1)) within the same bound: a longer call keeps the slots busy
  while its last rows finish.

Where the device reports no memory (XLA:CPU), a shard decodes all its rows at once in one call.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from absl import logging
from jax.sharding import Mesh

from dapo_jax import engine, paged_attention, sizes
from dapo_jax.decoding import SamplingConfig
from dapo_jax.errors import ConfigError
from dapo_jax.model import ModelConfig, Transformer
from dapo_jax.sampler import Sampler

HEADROOM = 0.1  # of a chip's HBM, for the programs' temporaries (4-6% in the configs' AOT)


class EnginePlan(NamedTuple):
    """A data shard's engine sizes; None: all rows at once, one call."""

    slots: int | None  # S
    prompts: int | None  # P_c


def page_bytes(config: ModelConfig, page_size: int, tensor: int) -> int:
    """b: one page of every layer's keys and values on a chip, in the compute dtype, its kv heads
    split over `tensor` chips where they divide."""
    heads = config.num_kv_heads // tensor if config.num_kv_heads % tensor == 0 else config.num_kv_heads
    return page_size * 2 * heads * config.head_dim * config.num_layers * config.compute_dtype.itemsize


def plan(
    prompts: int,
    group: int,
    prompt_pages: int,
    table_pages: int,
    page: int,
    resident: float,
    hbm: float | None,
    max_slots: int | None = None,
) -> EnginePlan:
    """S and P_c (module docstring) of a shard's P = `prompts` prompts, G = `group` rows each,
    J = `prompt_pages` and I = `table_pages`, pages of b = `page` bytes, R = `resident` bytes
    beside them on a chip of H = `hbm` bytes (None: unknown), S at most `max_slots` (None: no
    bound). A ConfigError naming the figures where one slot and one prompt do not fit."""
    if hbm is None:
        return EnginePlan(None, None)
    pages = ((1 - HEADROOM) * hbm - resident) // page  # the pool's most pages
    slot, least = table_pages + 1, prompt_pages + table_pages + 1
    if pages < least:
        raise ConfigError(
            f"the rollout engine's least pool ({least} pages of {page / 2**20:.2f} MiB: one prompt and one "
            f"slot at max_new_tokens) does not fit a chip of {hbm / 2**30:.1f} GiB beside the "
            f"{resident / 2**30:.1f} GiB resident and {HEADROOM:.0%} kept for temporaries: "
            "shorten rollout.max_new_tokens, or split the model over more chips (mesh.tensor, mesh.fsdp)"
        )
    fit = int((pages - prompt_pages) // slot)
    slots = min(1 << min(fit, max_slots or fit).bit_length() - 1, prompts * group)
    fits = [d for d in range(1, prompts + 1) if prompts % d == 0 and d * prompt_pages + slots * slot <= pages]
    return EnginePlan(slots, max(fits))  # d = 1 fits: J + S x (I + 1) <= pages by S


def device_hbm(device) -> float | None:
    """The bytes a device's programs may use (`bytes_limit`), None where it reports none
    (XLA:CPU, abstract devices)."""
    stats = device.memory_stats()
    return None if stats is None else stats.get("bytes_limit")


def planned_sampler(
    m: Transformer,
    config: SamplingConfig,
    mesh: Mesh,
    prompts: int,
    group: int,
    resident: float,
    hbm: float | None,
) -> Sampler:
    """The Sampler of `m` on `mesh` for calls of up to P = `prompts` prompts of G = `group` rows:
    with the engine (`config.paged`), its slots and a call's prompts planned per data shard
    (`plan`) for R = `resident` bytes on chips of `hbm` bytes; the fixed batch decodes all at once."""
    if not config.paged:
        return Sampler(m, config, mesh)
    d = mesh.shape["data"] * mesh.shape["fsdp"]
    shard_prompts = sizes.padded_count(prompts, d) // d
    geo = engine.geometry(config, 1, group, max(config.prompt_buckets))
    page = page_bytes(m.config, config.page_size, mesh.shape["tensor"])
    kernel = paged_attention.uses_kernel(m.config.head_dim, mesh)
    most = paged_attention.kernel_max_rows(geo.table_pages) if kernel else None
    e = plan(shard_prompts, group, geo.prompt_pages, geo.table_pages, page, resident, hbm, most)
    logging.info(
        "rollout engine, a data shard of %d: %s slots, %s of %d prompts a call (pages of %.2f MiB, "
        "%.1f GiB resident, a chip of %s bytes)",
        d,
        e.slots,
        e.prompts,
        shard_prompts,
        page / 2**20,
        resident / 2**30,
        hbm,
    )
    config = dataclasses.replace(config, decode_slots=e.slots and e.slots * d)
    return Sampler(m, config, mesh, e.prompts and e.prompts * d)
