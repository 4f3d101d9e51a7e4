"""Supervised fine-tuning on worked solutions: how the shipped tiny base model is made
(experiments/make_tiny_model.py) and the ablation's SFT control row (dapo_jax.ablation).

A row is a prompt x (token ids, as the RL run builds them) and its worked solution y (the
synthetic task's `extra_info.solution`), trained on as x + y + EOS:

    loss(θ) = - sum_{i,t} m_{i,t} log pi_θ(y_{i,t} | x_i, y_{i,<t}) / sum_{i,t} m_{i,t}

m the mask of the solution tokens and the EOS (a token mean, like DAPO's policy loss), at
temperature 1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dapo_jax import logprobs
from dapo_jax import model as model_lib


def sft_batch(
    prompt_ids: list, solution_ids: list, eos_id: int, pad_id: int, seq_len: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens_BxT int32, mask_BxT, loss_mask_BxT): x + y + EOS right-padded to `seq_len` (cut
    there if longer), mask on real tokens, loss mask on y and the EOS."""
    tokens_BxT = np.full((len(prompt_ids), seq_len), pad_id, np.int32)
    mask_BxT = np.zeros((len(prompt_ids), seq_len), bool)
    loss_mask_BxT = np.zeros((len(prompt_ids), seq_len), bool)
    for b, (x, y) in enumerate(zip(prompt_ids, solution_ids)):
        ids = (list(x) + list(y) + [eos_id])[:seq_len]
        tokens_BxT[b, : len(ids)] = ids
        mask_BxT[b, : len(ids)] = True
        loss_mask_BxT[b, len(x) : len(ids)] = True
    return tokens_BxT, mask_BxT, loss_mask_BxT


def nll(model, params, tokens_BxT, mask_BxT, loss_mask_BxT) -> jax.Array:
    """The token-mean negative log-likelihood of the loss-masked tokens (module docstring)."""
    logits_BxTxV = model_lib.forward(model, params, tokens_BxT, mask_BxT)
    logp_BxT, _ = logprobs.shifted_logp_and_entropy(logits_BxTxV, tokens_BxT, 1.0)
    m_BxT = loss_mask_BxT.astype(jnp.float32)
    return -jnp.sum(logp_BxT * m_BxT) / jnp.maximum(jnp.sum(m_BxT), 1.0)


def make_sft_step(model, optimizer: optax.GradientTransformation):
    """`step(params, opt_state, tokens_BxT, mask_BxT, loss_mask_BxT) -> (params, opt_state, loss)`,
    jitted, params and optimizer state donated."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens_BxT, mask_BxT, loss_mask_BxT):
        loss, grads = jax.value_and_grad(functools.partial(nll, model))(
            params, tokens_BxT, mask_BxT, loss_mask_BxT
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step
