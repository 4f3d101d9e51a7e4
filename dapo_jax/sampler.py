"""Rollouts: prefill P left-padded prompts once, then sample G completions of each in one jitted
loop (the layout, log-probs and randomness both loops share: `decoding`).

Two loops, chosen by `paged`:
- The engine (`paged`, `engine.py`): continuous batching in S = `decode_slots` slots (None:
  all rows) over a paged KV cache, a pool of `kv_pages` pages of `page_size` slots, each row
  attending over only the pages it holds; a prompt's full pages shared by its G rows. A row
  ends, its slot and pages free at once, the next waiting row starts: the loop's steps follow
  the sum of the rows' lengths over S, not the longest. The TPU configs' path.
- The fixed batch (`fixed_batch.py`): all rows decoded together until the longest ends; on
  XLA:CPU the faster loop at uniform lengths (experiments/README.md).

Devices. P is filled up to a multiple of the d data x fsdp shards with copies of the last prompt,
whose rows are dropped. With the engine, or on a mesh that splits only the batch, each shard
runs the loop by itself (`sharding.loop_per_data_shard`) on its P / d prompts, all their rows,
tensor parallel inside: no shard waits for another's longest row. The fixed batch on a mesh
that also splits the weights runs one loop over the mesh, its stopping test agreed at every
step: XLA's partitioning of its cache puts collective permutes in the loop, which on XLA:CPU
wait for every device of the mesh, so loops that stop at different steps deadlock (seen with
bf16 weights on data 4 x tensor 2).

The rows' tokens and log-probs do not depend on the loop, the slot count, the batch, the devices
or the slots a row is given (to float rounding of the attention sums, ~1e-7).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dapo_jax import engine, fixed_batch, sharding, sizes
from dapo_jax.decoding import Samples, SamplingConfig, row_uniforms
from dapo_jax.model import Transformer


def rollout(
    model: Transformer, config: SamplingConfig, group_size: int, params, prompt_PxQ, mask_PxQ, uids_P, rng
) -> Samples:
    """G = `group_size` completions of each of P left-padded prompts (pure; jitted by `Sampler`): the
    engine (`config.paged`) or the fixed batch."""
    u_BxN = row_uniforms(rng, uids_P, group_size, config.max_new_tokens)
    args = (params, prompt_PxQ, mask_PxQ.astype(bool), u_BxN)
    if config.paged:
        return engine.paged_rollout(model, config, group_size, *args)[0]
    return fixed_batch.rollout(model, config, group_size, *args)


def _fit_bucket(prompt_PxQ: np.ndarray, mask_PxQ: np.ndarray, buckets: tuple[int, ...], pad_id: int):
    """Re-pad a left-padded batch to the smallest bucket that holds its longest prompt."""
    mask_PxQ = np.asarray(mask_PxQ, bool)
    lengths_P = mask_PxQ.sum(-1)
    if np.any(np.diff(mask_PxQ.astype(np.int8), axis=-1) < 0):
        raise ValueError("prompts must be left padded: a pad follows a real token")
    if lengths_P.min(initial=1) < 1:
        raise ValueError("every prompt needs at least one real token")
    longest = int(lengths_P.max())
    fits = [b for b in buckets if b >= longest]
    if not fits:
        raise ValueError(f"a prompt of {longest} tokens exceeds the largest bucket {buckets[-1]}")
    width, q = fits[0], prompt_PxQ.shape[1]
    if width <= q:
        return np.asarray(prompt_PxQ[:, q - width :], np.int32), mask_PxQ[:, q - width :]
    pad = ((0, 0), (width - q, 0))
    return (
        np.pad(np.asarray(prompt_PxQ, np.int32), pad, constant_values=pad_id),
        np.pad(mask_PxQ, pad, constant_values=False),
    )


def _fitted_call(fn, params, prompt_PxQ, mask_PxQ, uids_P, rng, group_size: int, devices: int) -> Samples:
    """`fn`'s P x G rows, `fn` called on the prompts filled up to a multiple of `devices`
    (`sizes.padded_count`, copies of the last prompt) and the fill's rows dropped."""
    p = prompt_PxQ.shape[0]
    fit = sizes.padded_count(p, devices)
    out = fn(params, *(sizes.pad_rows(x, fit) for x in (prompt_PxQ, mask_PxQ, uids_P)), rng)
    return out if fit == p else jax.tree.map(lambda x: x[: p * group_size], out)


class Sampler:
    """Rollouts of `model` with the trainer's parameters, where they lie on `mesh`.

    One compilation per (prompt bucket, P, G); `num_traces` counts them. The KV cache beside the
    weights holds, with the engine, `config.kv_pages` pages a shard; with a fixed batch, the
    batch's rows, or with `micro_batch_prompts` that many prompts x G at a time.
    """

    def __init__(
        self, model: Transformer, config: SamplingConfig, mesh: Mesh, micro_batch_prompts: int | None = None
    ):
        self.model, self.config, self.mesh = model, config, mesh
        self.micro_batch_prompts = micro_batch_prompts  # prompts decoded at once (None: all)
        self.num_traces = 0
        self._param_shardings = sharding.param_shardings(model, mesh)
        self._data_size = mesh.shape["data"] * mesh.shape["fsdp"]
        sizes.check_decode_slots(config.decode_slots, self._data_size)
        self._jitted = {}  # G -> jitted rollout

    def _rollout_fn(self, group_size: int):
        if group_size in self._jitted:
            return self._jitted[group_size]
        d = self._data_size
        config = self.config.for_shard(d)

        def traced(*args):
            self.num_traces += 1
            return rollout(self.model, config, group_size, *args)

        per_shard = d > 1 and (config.paged or sharding.splits_only_the_batch(self.mesh))
        fn = sharding.loop_per_data_shard(traced, self.mesh) if per_shard else traced
        rep = sharding.replicated(self.mesh)
        out = Samples(
            *(sharding.batch_sharding(self.mesh, 2) for _ in range(3)),
            *(sharding.batch_sharding(self.mesh, 1) for _ in range(2)),
        )
        self._jitted[group_size] = jax.jit(
            fn, in_shardings=(self._param_shardings, rep, rep, rep, rep), out_shardings=out
        )
        return self._jitted[group_size]

    def generate(self, params, prompt_PxQ, mask_PxQ, group_size: int, rng, uids_P=None) -> Samples:
        """G = `group_size` completions of each left-padded prompt, B = P*G rows (`Samples`). `uids_P`
        (default 0..P-1) seed each prompt's rows with its own key.
        Any P and G: prompts that do not split over the data x fsdp shards are filled up to a
        count that does (`sizes.padded_count`) with copies of the last one, whose rows are
        dropped (the rows then come back replicated)."""
        p = prompt_PxQ.shape[0]
        uids_P = np.arange(p, dtype=np.int32) if uids_P is None else np.asarray(uids_P, np.int32)
        prompt_PxQ, mask_PxQ = _fit_bucket(
            prompt_PxQ, mask_PxQ, self.config.prompt_buckets, self.config.pad_id
        )
        m = self.micro_batch_prompts or p
        fn = self.program(group_size)
        outs = []
        for i in range(0, p, m):  # each row's samples depend on its uid only, not on m
            part = [x[i : i + m] for x in (prompt_PxQ, mask_PxQ, uids_P)]
            outs.append(_fitted_call(fn, params, *part, rng, group_size, self._data_size))
        return outs[0] if len(outs) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs), *outs)

    def program(self, group_size: int):
        """The compiled rollout of one micro-batch, G = `group_size` samples a prompt: `fn(params, prompt_PxQ,
        mask_PxQ, uids_P, rng) -> Samples` of P*G rows (prompts in a bucket, left padded, P a
        multiple of the data x fsdp shards), and `fn.lower(...)` of the same arguments as
        ShapeDtypeStructs (the AOT check). The one entry of the rollout's program, built once per G."""
        return sharding.on_mesh(self._rollout_fn(group_size), self.mesh)
