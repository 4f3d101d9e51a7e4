"""Log-probabilities of tokens under the model: log pi_θ(o_t | q, o_<t) and the entropy of each
prediction, aligned with the tokens (entry t from the logits at t - 1), over micro-batches of rows
(the log-prob pass of log pi_old and log pi_ref; the update's forward, `train_step`).

Rows are padded rows (a boolean mask) or packed rows (`dapo_jax.packing`: segment ids as the mask).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from dapo_jax import model as model_lib
from dapo_jax import objective, sharding

# A block of LM head logits holds at most this many a row (f32: 2 GiB)
BLOCK_LOGITS = 2**29


def logits_block(t: int, v: int) -> int:
    """C, the tokens per block of the LM head and log-softmax over T tokens and a vocabulary of V:
    all T while a row's T x V logits fit `BLOCK_LOGITS` (2^29), else the largest power of two
    with C x V <= 2^29. At Qwen2.5's V = 152,064 and T = 22,528 that is 2048 (2^29 / 152,064 =
    3530.6): 2048 x 152,064 logits a block, not 22,528 x 152,064 (~13 GB in f32)."""
    return model_lib.block_size(t, v, BLOCK_LOGITS)


def split_micro(x, n: int):
    """[B, ...] -> [n, B / n, ...]; micro-batch k holds rows k, k + n, ..., so that each one is
    spread evenly over the data-parallel shards of the batch axis."""
    if x.shape[0] % n:
        raise ValueError(f"batch of {x.shape[0]} rows does not split into {n} micro-batches")
    x = x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)
    return nn.with_logical_constraint(x, (None, "batch") + (None,) * (x.ndim - 2))


def merge_micro(x):
    """Inverse of `split_micro`."""
    return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])


def micro_count(rows: int, micro_rows: int | None) -> int:
    """The micro-batches of `micro_rows` rows (None: all) in a batch of `rows` (packed rows: their
    count varies with the lengths, one program per count)."""
    if micro_rows is None:
        return 1
    if rows % micro_rows:
        raise ValueError(f"{rows} rows do not split into micro-batches of {micro_rows}")
    return rows // micro_rows


def shifted_logp_and_entropy(logits_BxTxV, tokens_BxT, temperature: float):
    """`(logp_BxT, entropy_BxT)` aligned with tokens: entry t is log pi(token_t | tokens_<t) and the
    entropy of that prediction, both from the logits at t - 1; entry 0 is 0."""
    next_BxT = jnp.roll(tokens_BxT, -1, axis=1)
    logp_BxT, entropy_BxT = objective.token_logp_and_entropy(logits_BxTxV, next_BxT, temperature)
    shift = lambda x_BxT: jnp.pad(x_BxT[:, :-1], ((0, 0), (1, 0)))
    return shift(logp_BxT), shift(entropy_BxT)


def chunked_logp_and_entropy(
    config: model_lib.ModelConfig,
    params,
    x_BxTxD,
    targets_BxT,
    temperature: float,
    chunk: int,
    remat: bool = True,
):
    """`objective.token_logp_and_entropy` of the logits `lm_head(x)`, computed over blocks of
    `chunk` tokens (one block when T <= chunk). Each block's B x chunk x V logits
    are made, reduced to log p and H and dropped; with `remat` they are recomputed in the backward
    pass, which then also holds one block's logits at a time, not T x V of them (~13 GB of f32
    logits per 20k-token sequence at Qwen's 152k vocabulary)."""

    def block(x_bxCxD, targets_bxC):
        logits_bxCxV = nn.with_logical_constraint(
            model_lib.lm_head(config, params, x_bxCxD), ("batch", "length", "vocab")
        )
        return objective.token_logp_and_entropy(logits_bxCxV, targets_bxC, temperature)

    b, t, d = x_BxTxD.shape
    if t <= chunk:
        return block(x_BxTxD, targets_BxT)
    n = -(-t // chunk)
    pad = ((0, 0), (0, n * chunk - t))  # padded tokens' values are dropped
    x_NxBxCxD = jnp.pad(x_BxTxD, pad + ((0, 0),)).reshape(b, n, chunk, d).swapaxes(0, 1)
    targets_NxBxC = jnp.pad(targets_BxT, pad).reshape(b, n, chunk).swapaxes(0, 1)
    one = lambda xs: block(*xs)
    logp_NxBxC, entropy_NxBxC = jax.lax.map(jax.checkpoint(one) if remat else one, (x_NxBxCxD, targets_NxBxC))
    merge = lambda v_NxBxC: v_NxBxC.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
    return merge(logp_NxBxC), merge(entropy_NxBxC)


def model_logp_and_entropy(model, params, tokens_BxT, mask_BxT, temperature: float):
    """`shifted_logp_and_entropy` of the model's teacher-forced pass, the LM head and log-softmax
    over blocks of `logits_block(T, V)` tokens (`chunked_logp_and_entropy`)."""
    x_BxTxD = model_lib.forward_hidden(model, params, tokens_BxT, mask_BxT)
    next_BxT = jnp.roll(tokens_BxT, -1, axis=1)
    chunk = logits_block(tokens_BxT.shape[1], model.config.vocab_size)
    logp_BxT, entropy_BxT = chunked_logp_and_entropy(
        model.config, params, x_BxTxD, next_BxT, temperature, chunk
    )
    shift = lambda x_BxT: jnp.pad(x_BxT[:, :-1], ((0, 0), (1, 0)))
    return shift(logp_BxT), shift(entropy_BxT)


def compute_logprobs(model, params, tokens_BxT, mask_BxT, temperature: float, micro_rows: int | None = None):
    """log pi_params(token_t | tokens_<t) aligned with tokens (entry 0 and padding: don't care),
    one forward per micro-batch of `micro_rows` rows (`lax.map`; None: one of every row) to bound
    the memory of the logits; packed rows take their segment ids as `mask_BxT`."""

    def one(micro):
        tokens_bxT, mask_bxT = micro
        return model_logp_and_entropy(model, params, tokens_bxT, mask_bxT, temperature)[0]

    split = functools.partial(split_micro, n=micro_count(tokens_BxT.shape[0], micro_rows))
    return merge_micro(jax.lax.map(one, (split(tokens_BxT), split(mask_BxT))))


def make_compute_logprobs(model, mesh, temperature: float, micro_rows: int):
    """`compute_logprobs` jitted on `mesh`: `fn(params, tokens_BxT, mask_BxT) -> logp_BxT`."""
    fn = functools.partial(compute_logprobs, model, temperature=temperature, micro_rows=micro_rows)
    rows = sharding.batch_sharding(mesh, 2)
    jitted = jax.jit(fn, in_shardings=(sharding.param_shardings(model, mesh), rows, rows), out_shardings=rows)
    return sharding.on_mesh(jitted, mesh)
