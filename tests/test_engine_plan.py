"""The engine's sizes from the chip's memory (dapo_jax.engine_plan), computed by hand."""

import pytest

from dapo_jax import engine_plan
from dapo_jax.errors import ConfigError
from dapo_jax.model import ModelConfig

GIB, MIB = 2**30, 2**20
QWEN2_5_32B = ModelConfig(
    vocab_size=152064,
    hidden_size=5120,
    intermediate_size=27648,
    num_layers=64,
    num_heads=40,
    num_kv_heads=8,
    head_dim=128,
    dtype="bfloat16",
)
# DAPO's lengths in pages of 16: a prompt of up to 2048 tokens keeps ceil(2047 / 16) = 128 pages,
# a row at 20,480 new tokens ceil(22527 / 16) = 1408
J, I = 128, 1408


def test_a_page_is_every_layers_keys_and_values_of_the_chips_heads():
    # 16 slots x (k, v) x 1 of 8 kv heads x 128 x 64 layers x 2 bytes (bf16)
    assert engine_plan.page_bytes(QWEN2_5_32B, 16, 8) == 16 * 2 * 1 * 128 * 64 * 2 == MIB // 2
    # 8 kv heads do not split over 3 chips: each holds all 8
    assert engine_plan.page_bytes(QWEN2_5_32B, 16, 3) == 4 * MIB


def test_the_32b_configs_plans_on_v5p():
    """v5p-128 (a shard: 192 prompts, R ~ 14 GiB): the pool may take 0.9 x 95 - 14 = 71.5 GiB =
    146,432 half-MiB pages. Slots: (146,432 - 128) // 1409 = 103, so 64 (a power of two); then
    64 x 1409 = 90,176 pages leave 56,256 for prompts, 439 of them: all 192 in one call.
    v5p-64 (a shard: 384 prompts, R ~ 20.5 GiB): 65 GiB = 133,120 pages; slots (133,120 - 128)
    // 1409 = 94, so 64; 42,944 pages left hold 335 prompts, and the largest divisor of 384 up
    to that is 192: two calls."""
    half = MIB // 2
    assert engine_plan.plan(192, 16, J, I, half, 14 * GIB, 95 * GIB) == (64, 192)
    assert engine_plan.plan(384, 16, J, I, half, 20.5 * GIB, 95 * GIB) == (64, 192)


def test_the_slots_stop_where_the_kernels_page_tables_fill_its_scalar_memory():
    """7/8 of 1 MiB holds 917,504 / (4 x 1408) = 162 rows' tables at 20,480 new tokens: 128 slots
    (a power of two), however much HBM there is; then 128 x 1409 = 180,352 pages beside 192 x 128
    prompts' fit 1 TiB."""
    assert engine_plan.paged_attention.kernel_max_rows(I) == 162
    assert engine_plan.plan(192, 16, J, I, MIB // 2, 0, 2**40, max_slots=162) == (128, 192)


def test_the_slots_stop_at_the_calls_rows_and_unknown_memory_takes_all_rows():
    # 2 prompts x G = 4 are 8 rows, whatever room there is; J + I + 1 = 3 pages of 1 MiB for one slot
    assert engine_plan.plan(2, 4, 1, 1, MIB, 0, 10 * GIB) == (8, 2)
    assert engine_plan.plan(2, 4, 1, 1, MIB, 0, None) == (None, None)
    # room for 10 pages (0.9 x 100 MiB - 80 MiB): 4 slots (the power of two <= (10 - 1) // 2),
    # whose 8 pages leave 2 for prompts: both
    assert engine_plan.plan(2, 4, 1, 1, MIB, 80 * MIB, 100 * MIB) == (4, 2)
    # 3 prompts and room for 9 pages: 4 slots (8 pages) leave 1: one prompt a call
    assert engine_plan.plan(3, 4, 1, 1, MIB, 80 * MIB, 98.9 * MIB) == (4, 1)


def test_a_chip_too_small_for_one_slot_names_the_figures():
    message = (
        r"^the rollout engine's least pool \(1537 pages of 0.50 MiB: one prompt and one slot at "
        r"max_new_tokens\) does not fit a chip of 16.0 GiB beside the 14.0 GiB resident"
    )
    with pytest.raises(ConfigError, match=message):
        engine_plan.plan(192, 16, J, I, MIB // 2, 14 * GIB, 16 * GIB)
