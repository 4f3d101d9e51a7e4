"""The train batch from the host to the devices: the filtered rows (`records.TrainBatch`) as the
token, mask and advantage arrays the update trains on, cut to the widths the rows use, packed
(`packing`), and placed on the mesh's batch axes.

Host code but for `to_device`; the arrays are identical on every process.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import ml_collections
import numpy as np

from dapo_jax import objective, packing, sharding, train_step
from dapo_jax.records import TrainBatch


def prompt_width(batch: TrainBatch, length_bucket: int) -> int:
    """The prompt columns the trainer keeps: the last ones, from the first column where a row has
    a real token, rounded up to a multiple of `length_bucket` (at most Q). The columns cut are
    padding in every row, so the loss and the gradient are unchanged."""
    prompt_mask_BxQ = batch.rows.prompt_mask_BxQ
    q = prompt_mask_BxQ.shape[1]
    if not prompt_mask_BxQ.any():
        return 0
    return train_step.bucket_width(q - int(np.argmax(prompt_mask_BxQ.any(axis=0))), length_bucket, q)


def host_rollout(
    batch: TrainBatch, group_size: int, normalize_std: bool, length_bucket: int
) -> train_step.Rollout:
    """Host arrays of the train batch: prompt + response tokens, masks and advantages A_i.

    Response columns past the longest response, and prompt columns before the longest prompt,
    are cut, each width rounded up to a multiple of `length_bucket`: the trainer then compiles
    few shapes (`assemble` then packs the rows into rows of that width)."""
    rows, valid_B = batch.rows, batch.valid_B
    n = rows.tokens_BxN.shape[1]
    width = train_step.bucket_width(int(rows.length_B.max()), length_bucket, n)
    q0 = rows.prompt_tokens_BxQ.shape[1] - prompt_width(batch, length_bucket)
    prompt_mask_BxQ = rows.prompt_mask_BxQ[:, q0:]
    response_mask_BxN = rows.mask_BxN[:, :width]
    tokens_BxT = np.concatenate([rows.prompt_tokens_BxQ[:, q0:], rows.tokens_BxN[:, :width]], axis=1)
    mask_BxT = np.concatenate([prompt_mask_BxQ, response_mask_BxN], axis=1)
    keep_BxN = response_mask_BxN & (valid_B & rows.loss_keep_B)[:, None]
    loss_mask_BxT = np.concatenate([np.zeros_like(prompt_mask_BxQ), keep_BxN], axis=1)
    adv_B = np.asarray(objective.group_advantages(rows.reward_B, group_size, normalize_std))
    return train_step.Rollout(
        tokens_BxT.astype(np.int32), mask_BxT, loss_mask_BxT, np.where(valid_B, adv_B, 0.0).astype(np.float32)
    )


def sampler_logp(batch: TrainBatch, prompt_width: int, width: int) -> np.ndarray:
    """`logp_BxT` of the sampler aligned with `host_rollout`'s tokens of width T: 0 over the
    `prompt_width` prompt columns, the sampler's log-probs over the response ones."""
    rows = batch.rows
    prompt_BxQ = np.zeros((rows.logp_BxN.shape[0], prompt_width), np.float32)
    return np.concatenate([prompt_BxQ, rows.logp_BxN[:, : width - prompt_width]], axis=1)


def to_device(x: np.ndarray, mesh):
    """A host array, identical on every process, as a global array sharded over the batch axes."""
    s = sharding.batch_sharding(mesh, x.ndim)
    return jax.make_array_from_callback(x.shape, s, lambda index: x[index])


class Assembled(NamedTuple):
    """A train batch ready for the update: `host` the padded arrays (B rows of T columns),
    `device` the trained ones on the mesh (packed into Y rows under `layout`)."""

    host: train_step.Rollout
    device: train_step.Rollout
    layout: packing.Packing
    prompt_width: int

    def sampler_logp(self, batch: TrainBatch, mesh):
        """The sampler's log pi per token of `batch` (0 on prompts), on the mesh, packed: log
        pi_old under loss.old_logp="sampler", pi_sampler for the mismatch correction."""
        logp_BxT = sampler_logp(batch, self.prompt_width, self.host.tokens_BxT.shape[1])
        return to_device(packing.pack(self.layout, logp_BxT), mesh)


def assemble(batch: TrainBatch, c: ml_collections.ConfigDict, mesh) -> Assembled:
    """The train batch's arrays cut to widths of the run's length bucket
    (`train_step.length_bucket` of the longest prompt bucket + L_max), in its mini- and
    micro-batch sizes, packed and placed on `mesh`."""
    t = c.train
    bucket = train_step.length_bucket(max(c.data.prompt_buckets) + c.rollout.max_new_tokens)
    host = host_rollout(batch, c.rollout.group_size, c.loss.normalize_std, bucket)
    layout = packing.plan(host.mask_BxT, t.train_batch_prompts // t.mini_batch_prompts, t.micro_batch_size)
    packed = train_step.Rollout(*packing.pack_rows(layout, host.tokens_BxT, host.loss_mask_BxT, host.adv_B))
    device = train_step.Rollout(*(to_device(x, mesh) for x in packed))
    return Assembled(host, device, layout, prompt_width(batch, bucket))
