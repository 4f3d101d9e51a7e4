"""Dynamic sampling filter: exact trimming to whole groups, the bound, carry-over, cost model."""

import dataclasses
import math

import numpy as np
import pytest

from dapo_jax.dynamic_sampling import DynamicSampler
from dapo_jax.records import GenerationBatch

G = 2


def gen_batch(
    acc_B, problem_id_B=None, length_B=None, tokens_BxN=None, score_B=None, reward_B=None
) -> GenerationBatch:
    """A GenerationBatch of these fields, every other one zeros (pred: "p<problem id>")."""
    acc_B = np.asarray(acc_B, bool)
    b = len(acc_B)
    problem_id_B = np.zeros(b, np.int32) if problem_id_B is None else np.asarray(problem_id_B, np.int32)
    zeros = lambda dtype, *shape: np.zeros((b, *shape), dtype)
    return GenerationBatch(
        prompt_tokens_BxQ=zeros(np.int32, 3),
        prompt_mask_BxQ=zeros(bool, 3),
        tokens_BxN=zeros(np.int32, 2) if tokens_BxN is None else tokens_BxN,
        mask_BxN=zeros(bool, 2),
        logp_BxN=zeros(np.float32, 2),
        length_B=zeros(np.int32) if length_B is None else np.asarray(length_B, np.int32),
        truncated_B=zeros(bool),
        problem_id_B=problem_id_B,
        response_B=np.asarray([f"r{p}" for p in problem_id_B], str),
        pred_B=np.asarray([f"p{p}" for p in problem_id_B], str),
        score_B=zeros(np.float32) if score_B is None else np.asarray(score_B, np.float32),
        acc_B=acc_B,
        reward_B=zeros(np.float32) if reward_B is None else np.asarray(reward_B, np.float32),
        loss_keep_B=np.ones(b, bool),
    )


def scripted(groups_per_batch):
    """Generation batches given as lists of per-group acc pairs.

    Prompt ids count up across batches; row i of prompt p has length 10*p + i and a 2-token
    payload [p, i], so every row says where it came from.
    """
    batches, next_id = [], 0
    for groups in groups_per_batch:
        ids = np.arange(next_id, next_id + len(groups))
        next_id += len(groups)
        prompt_id = np.repeat(ids, G)
        row = np.tile(np.arange(G), len(groups))
        batches.append(
            gen_batch(
                np.array(groups, bool).reshape(-1),
                prompt_id,
                10 * prompt_id + row,
                np.stack([prompt_id, row], axis=1).astype(np.int32),
            )
        )
    return iter(batches)


def fill(sampler, source):
    """What the training loop does: add generation batches until full or bounded, then take."""
    while not (sampler.full or sampler.bound_reached):
        sampler.add(next(source))
    return sampler.take()


def ds(
    train_batch_prompts,
    group_size=G,
    max_num_gen_batches=10,
    *,
    enable=True,
    metric="acc",
    carry_over=False,
    on_exhausted="mask",
):
    return DynamicSampler(
        train_batch_prompts,
        group_size,
        max_num_gen_batches,
        enable=enable,
        metric=metric,
        carry_over=carry_over,
        on_exhausted=on_exhausted,
    )


# prompts:  p0 all-correct, p1 kept | p2 all-wrong, p3 kept | p4 kept, p5 kept |
#           p6 all-correct, p7 kept | p8 kept, p9 all-wrong | p10 kept, p11 kept
SCRIPT = [
    [(1, 1), (1, 0)],
    [(0, 0), (0, 1)],
    [(1, 0), (0, 1)],
    [(1, 1), (0, 1)],
    [(1, 0), (0, 0)],
    [(0, 1), (1, 0)],
]


def test_trims_to_whole_groups_and_discards_leftovers():
    source, sampler = scripted(SCRIPT), ds(3)
    batch, stats = fill(sampler, source)
    rows = batch.rows
    np.testing.assert_array_equal(rows.problem_id_B, [1, 1, 3, 3, 4, 4])
    np.testing.assert_array_equal(rows.tokens_BxN[:, 1], [0, 1, 0, 1, 0, 1])
    np.testing.assert_array_equal(rows.acc_B, [1, 0, 0, 1, 1, 0])
    np.testing.assert_array_equal(rows.pred_B, ["p1", "p1", "p3", "p3", "p4", "p4"])
    assert batch.valid_B.all() and batch.valid_B.shape == (6,) and not batch.carried_B.any()
    assert rows.tokens_BxN.dtype == np.int32
    assert stats["dynamic_sampling/gen_batches"] == 3
    assert stats["dynamic_sampling/prompts_consumed"] == 6
    assert stats["dynamic_sampling/kept_fraction"] == 4 / 6
    assert stats["dynamic_sampling/all_correct_fraction"] == 1 / 6
    assert stats["dynamic_sampling/all_wrong_fraction"] == 1 / 6
    assert stats["dynamic_sampling/groups_discarded"] == 1  # p5
    assert stats["dynamic_sampling/groups_carried_out"] == 0
    assert stats["dynamic_sampling/groups_masked"] == 0
    assert not stats["dynamic_sampling/exhausted"]
    # Lengths 0,1,10,11,...,50,51 -> 306/12.
    assert stats["before_filter/length_mean"] == 25.5
    assert stats["before_filter/acc_mean"] == 0.5
    assert not any(k.startswith("after_filter/") for k in stats)  # the loop's data/* say it

    batch, stats = fill(sampler, source)  # p5 was dropped: p7, p8, p10, and p11 is dropped
    np.testing.assert_array_equal(batch.rows.problem_id_B, [7, 7, 8, 8, 10, 10])
    assert stats["dynamic_sampling/gen_batches"] == 3
    assert stats["dynamic_sampling/groups_carried_in"] == 0


def test_carry_over_keeps_leftovers_and_checkpoints_them():
    source, sampler = scripted(SCRIPT), ds(3, carry_over=True)
    fill(sampler, source)
    state = sampler.state()
    assert all(
        isinstance(v, np.ndarray) and v.dtype != object and v.dtype.kind != "U"
        for v in state["carry"].values()
    )  # what orbax writes
    np.testing.assert_array_equal(state["carry"]["problem_id_B"], [5, 5])

    batch, stats = fill(sampler, source)  # p5 from the carry, then p7, p8 from two batches
    np.testing.assert_array_equal(batch.rows.problem_id_B, [5, 5, 7, 7, 8, 8])
    np.testing.assert_array_equal(batch.carried_B, [True, True, False, False, False, False])
    assert stats["dynamic_sampling/groups_carried_in"] == 1
    assert stats["dynamic_sampling/gen_batches"] == 2
    assert stats["dynamic_sampling/prompts_consumed"] == 4
    assert stats["dynamic_sampling/kept_fraction"] == 2 / 4
    assert stats["dynamic_sampling/groups_carried_out"] == 0

    # A fresh sampler restored from the checkpointed state continues identically.
    remaining = scripted(SCRIPT)
    for _ in range(3):
        next(remaining)
    resumed = ds(3, carry_over=True)
    resumed.restore({"carry": {k: v.copy() for k, v in state["carry"].items()}})
    again, _ = fill(resumed, remaining)
    for field in dataclasses.fields(batch.rows):
        np.testing.assert_array_equal(getattr(again.rows, field.name), getattr(batch.rows, field.name))
    np.testing.assert_array_equal(again.rows.pred_B, ["p5", "p5", "p7", "p7", "p8", "p8"])
    np.testing.assert_array_equal(again.carried_B, batch.carried_B)


def test_carried_predictions_survive_a_checkpoint_in_any_script():
    gen = gen_batch([True, False, False, True])
    gen = dataclasses.replace(gen, pred_B=np.asarray(["", "√2 ≈ 1.41"] * 2, str))
    sampler = ds(1, carry_over=True)
    sampler.add(gen)
    sampler.take()
    restored = ds(1, carry_over=True)
    restored.restore(sampler.state())
    np.testing.assert_array_equal(restored.take()[0].rows.pred_B, ["", "√2 ≈ 1.41"])


def test_carry_can_serve_a_whole_step():
    # Three kept groups per generation batch, B = 1: two are carried, and the next two steps
    # draw nothing (filter fractions are NaN then).
    source, sampler = scripted([[(1, 0), (0, 1), (1, 0)]]), ds(1, carry_over=True)
    ids = []
    for expected_gen_batches in (1, 0, 0):
        batch, stats = fill(sampler, source)
        ids.append(int(batch.rows.problem_id_B[0]))
        assert stats["dynamic_sampling/gen_batches"] == expected_gen_batches
        assert batch.carried_B.all() == (expected_gen_batches == 0)
    assert ids == [0, 1, 2]
    assert math.isnan(stats["dynamic_sampling/kept_fraction"])
    assert math.isnan(stats["before_filter/length_mean"])
    assert sampler.state() == {"carry": {}}


def test_bound_hit_masks_missing_groups():
    script = [[(1, 1), (1, 0)], [(0, 0), (0, 0)]]
    batch, stats = fill(ds(3, max_num_gen_batches=2), scripted(script))
    rows = batch.rows
    np.testing.assert_array_equal(batch.valid_B, [True, True, False, False, False, False])
    np.testing.assert_array_equal(rows.problem_id_B, [1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(rows.tokens_BxN, [[1, 0], [1, 1], [0, 0], [0, 0], [0, 0], [0, 0]])
    np.testing.assert_array_equal(rows.acc_B, [True, False, False, False, False, False])
    np.testing.assert_array_equal(rows.pred_B, ["p1", "p1", "", "", "", ""])
    assert stats["dynamic_sampling/groups_masked"] == 2
    assert stats["dynamic_sampling/exhausted"]
    assert stats["dynamic_sampling/gen_batches"] == 2
    assert stats["dynamic_sampling/kept_fraction"] == 0.25
    assert stats["dynamic_sampling/all_correct_fraction"] == 0.25
    assert stats["dynamic_sampling/all_wrong_fraction"] == 0.5

    with pytest.raises(RuntimeError, match="kept 1 of 3 groups after 2"):
        fill(ds(3, max_num_gen_batches=2, on_exhausted="raise"), scripted(script))


def test_no_filter_takes_groups_as_they_come():
    batch, stats = fill(ds(3, enable=False), scripted(SCRIPT))
    np.testing.assert_array_equal(batch.rows.problem_id_B, [0, 0, 1, 1, 2, 2])
    assert stats["dynamic_sampling/kept_fraction"] == 1.0
    assert stats["dynamic_sampling/all_correct_fraction"] == 0.25
    assert stats["dynamic_sampling/groups_discarded"] == 1


def test_bad_generation_batches_and_settings_are_rejected():
    with pytest.raises(ValueError, match="multiple of G=2 rows; got 3"):
        ds(1).add(gen_batch(np.zeros(3, bool)))
    with pytest.raises(ValueError, match="differ in their number of rows"):
        dataclasses.replace(gen_batch(np.zeros(4, bool)), score_B=np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="on_exhausted"):
        ds(1, on_exhausted="crash")
    with pytest.raises(ValueError, match="metric must be one of"):
        ds(1, metric="length")
    with pytest.raises(RuntimeError, match="add"):
        ds(1).take()


def test_no_max_num_gen_batches_means_no_bound():
    # Ten all-correct batches, then one kept group per batch: 13 batches fill 3 groups.
    script = [[(1, 1), (0, 0)]] * 10 + [[(1, 0), (1, 1)]] * 3
    batch, stats = fill(ds(3, max_num_gen_batches=None), scripted(script))
    assert stats["dynamic_sampling/gen_batches"] == 13
    np.testing.assert_array_equal(batch.rows.problem_id_B, [20, 20, 22, 22, 24, 24])
    assert batch.valid_B.all()


def test_filter_on_score_or_reward_keeps_groups_that_differ_there():
    # Both groups are all-wrong by acc; the second differs in the shaped reward only.
    gen = gen_batch(
        np.zeros(4, bool),
        np.repeat([0, 1], 2),
        score_B=np.full(4, -1.0),
        reward_B=np.array([-1.0, -1.0, -1.0, -1.5]),
    )
    kept = lambda metric: fill(ds(1, max_num_gen_batches=1, metric=metric), iter([gen]))[0]
    assert not kept("acc").valid_B.any() and not kept("score").valid_B.any()
    np.testing.assert_array_equal(kept("reward").rows.problem_id_B, [1, 1])


def test_a_group_of_one_is_kept():
    # std over one response is 0 whatever it scored; the recipe keeps such groups, and so do we.
    gen = gen_batch([True, False, True])
    batch, stats = fill(ds(3, 1, 1), iter([gen]))
    assert batch.valid_B.all() and stats["dynamic_sampling/kept_fraction"] == 1.0


@pytest.mark.parametrize("q", [0.3, 0.9])
def test_prompts_consumed_matches_cost_model(q):
    """One prompt per generation batch: prompts to fill B groups ~ B/p, p = 1 - q^G - (1-q)^G."""
    group_size, groups, steps = 4, 8, 1500
    rng = np.random.default_rng(0)
    source = iter(lambda: gen_batch(rng.random(group_size) < q), None)
    sampler = ds(groups, group_size, max_num_gen_batches=10_000)
    consumed = [fill(sampler, source)[1]["dynamic_sampling/prompts_consumed"] for _ in range(steps)]
    p = 1 - q**group_size - (1 - q) ** group_size  # q=0.3: 0.7518, q=0.9: 0.3438
    assert np.mean(consumed) == pytest.approx(groups / p, rel=0.03)
