"""Synthetic rows at DAPO's length distribution, to size programs and count decode steps ahead of
time (`dapo_jax.aot`'s packed programs and engine)."""

from __future__ import annotations

import numpy as np


def dapo_rows(rows: int, prompt_len: int, new_tokens: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`(prompt_B, response_B)`: tokens of `rows` synthetic rows at DAPO's length distribution:
    4% of responses at L_max, the others exponential with mean 0.17 L_max (below L_max), a mean
    response of ~0.2 L_max (4.1k of 20,480); prompts uniform in [L / 16, L / 8] of the longest
    prompt bucket L (DAPO-Math's prompts: a few hundred tokens of 2,048)."""
    rng = np.random.default_rng(seed)
    response_B = np.minimum(rng.exponential(0.17 * new_tokens, rows).astype(int) + 1, new_tokens - 1)
    response_B[rng.random(rows) < 0.04] = new_tokens
    return rng.integers(prompt_len // 16, prompt_len // 8 + 1, rows), response_B


def dapo_lengths(rows: int, prompt_len: int, new_tokens: int, seed: int = 0) -> np.ndarray:
    """Real tokens (prompt + response) of `dapo_rows`."""
    return sum(dapo_rows(rows, prompt_len, new_tokens, seed))
