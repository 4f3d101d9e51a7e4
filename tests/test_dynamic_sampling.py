"""Dynamic sampling filter: exact trimming to whole groups, the bound, carry-over, cost model."""

import math

import numpy as np
import pytest

from dapo_jax.dynamic_sampling import DynamicSampler

G = 2


def scripted(groups_per_batch):
    """generate_fn replaying generation batches given as lists of per-group acc pairs.

    Prompt ids count up across batches; row i of prompt p has length 10*p + i and a 2-token
    payload [p, i], so every row says where it came from.
    """
    batches, next_id = [], 0
    for groups in groups_per_batch:
        ids = np.arange(next_id, next_id + len(groups))
        next_id += len(groups)
        prompt_id = np.repeat(ids, G)
        row = np.tile(np.arange(G), len(groups))
        batches.append({"acc": np.array(groups, bool).reshape(-1),
                        "prompt_id": prompt_id,
                        "length": 10 * prompt_id + row,
                        "tokens": np.stack([prompt_id, row], axis=1).astype(np.int32)})
    calls = iter(batches)
    return lambda: next(calls)


# prompts:  p0 all-correct, p1 kept | p2 all-wrong, p3 kept | p4 kept, p5 kept |
#           p6 all-correct, p7 kept | p8 kept, p9 all-wrong | p10 kept, p11 kept
SCRIPT = [[(1, 1), (1, 0)], [(0, 0), (0, 1)], [(1, 0), (0, 1)],
          [(1, 1), (0, 1)], [(1, 0), (0, 0)], [(0, 1), (1, 0)]]


def test_trims_to_whole_groups_and_discards_leftovers():
    sampler = DynamicSampler(scripted(SCRIPT), train_batch_groups=3, group_size=G,
                             max_num_gen_batches=10)
    batch, stats = sampler.next_batch()
    np.testing.assert_array_equal(batch["prompt_id"], [1, 1, 3, 3, 4, 4])
    np.testing.assert_array_equal(batch["tokens"][:, 1], [0, 1, 0, 1, 0, 1])
    np.testing.assert_array_equal(batch["acc"], [1, 0, 0, 1, 1, 0])
    assert batch["valid"].all() and batch["valid"].shape == (6,)
    assert batch["tokens"].dtype == np.int32
    assert stats["dynamic_sampling/gen_batches"] == 3
    assert stats["dynamic_sampling/prompts_consumed"] == 6
    assert stats["dynamic_sampling/kept_fraction"] == 4 / 6
    assert stats["dynamic_sampling/all_correct_fraction"] == 1 / 6
    assert stats["dynamic_sampling/all_wrong_fraction"] == 1 / 6
    assert stats["dynamic_sampling/groups_discarded"] == 1  # p5
    assert stats["dynamic_sampling/groups_carried_out"] == 0
    assert stats["dynamic_sampling/groups_masked"] == 0
    assert not stats["dynamic_sampling/exhausted"]
    # Before: lengths 0,1,10,11,...,50,51 -> 306/12; after: p1, p3, p4 -> (21+61+81)/6.
    assert stats["before_filter/length_mean"] == 25.5
    assert stats["after_filter/length_mean"] == pytest.approx(163 / 6)
    assert stats["before_filter/acc_mean"] == 0.5
    assert "before_filter/score_mean" not in stats  # no "score" key in this generator

    batch, stats = sampler.next_batch()  # p5 was dropped: p7, p8, p10, and p11 is dropped
    np.testing.assert_array_equal(batch["prompt_id"], [7, 7, 8, 8, 10, 10])
    assert stats["dynamic_sampling/gen_batches"] == 3
    assert stats["dynamic_sampling/groups_carried_in"] == 0


def test_carry_over_keeps_leftovers_and_checkpoints_them():
    sampler = DynamicSampler(scripted(SCRIPT), 3, G, 10, carry_over=True)
    sampler.next_batch()
    state = sampler.state()
    assert all(isinstance(v, np.ndarray) for v in state["carry"].values())
    np.testing.assert_array_equal(state["carry"]["prompt_id"], [5, 5])

    batch, stats = sampler.next_batch()  # p5 from the carry, then p7, p8 from two batches
    np.testing.assert_array_equal(batch["prompt_id"], [5, 5, 7, 7, 8, 8])
    assert stats["dynamic_sampling/groups_carried_in"] == 1
    assert stats["dynamic_sampling/gen_batches"] == 2
    assert stats["dynamic_sampling/prompts_consumed"] == 4
    assert stats["dynamic_sampling/kept_fraction"] == 2 / 4
    assert stats["dynamic_sampling/groups_carried_out"] == 0

    # A fresh sampler restored from the checkpointed state continues identically.
    remaining = scripted(SCRIPT)
    for _ in range(3):
        remaining()
    resumed = DynamicSampler(remaining, 3, G, 10, carry_over=True)
    resumed.restore({"carry": {k: v.copy() for k, v in state["carry"].items()}})
    again, _ = resumed.next_batch()
    for key in batch:
        np.testing.assert_array_equal(again[key], batch[key])


def test_carry_can_serve_a_whole_step():
    # Three kept groups per generation batch, B = 1: two are carried, and the next two steps
    # draw nothing (filter fractions are NaN then).
    sampler = DynamicSampler(scripted([[(1, 0), (0, 1), (1, 0)]]), 1, G, 10, carry_over=True)
    ids = []
    for expected_gen_batches in (1, 0, 0):
        batch, stats = sampler.next_batch()
        ids.append(int(batch["prompt_id"][0]))
        assert stats["dynamic_sampling/gen_batches"] == expected_gen_batches
    assert ids == [0, 1, 2]
    assert math.isnan(stats["dynamic_sampling/kept_fraction"])
    assert stats["after_filter/length_mean"] == 20.5
    assert sampler.state() == {"carry": {}}


def test_bound_hit_masks_missing_groups():
    script = [[(1, 1), (1, 0)], [(0, 0), (0, 0)]]
    sampler = DynamicSampler(scripted(script), 3, G, max_num_gen_batches=2)
    batch, stats = sampler.next_batch()
    np.testing.assert_array_equal(batch["valid"], [True, True, False, False, False, False])
    np.testing.assert_array_equal(batch["prompt_id"], [1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch["tokens"], [[1, 0], [1, 1], [0, 0], [0, 0], [0, 0], [0, 0]])
    np.testing.assert_array_equal(batch["acc"], [True, False, False, False, False, False])
    assert stats["dynamic_sampling/groups_masked"] == 2
    assert stats["dynamic_sampling/exhausted"]
    assert stats["dynamic_sampling/gen_batches"] == 2
    assert stats["dynamic_sampling/kept_fraction"] == 0.25
    assert stats["dynamic_sampling/all_correct_fraction"] == 0.25
    assert stats["dynamic_sampling/all_wrong_fraction"] == 0.5
    assert stats["after_filter/length_mean"] == 10.5  # valid rows only

    raising = DynamicSampler(scripted(script), 3, G, 2, on_exhausted="raise")
    with pytest.raises(RuntimeError, match="kept 1 of 3 groups after 2"):
        raising.next_batch()


def test_no_filter_takes_groups_as_they_come():
    sampler = DynamicSampler(scripted(SCRIPT), 3, G, 10, filter_groups=False)
    batch, stats = sampler.next_batch()
    np.testing.assert_array_equal(batch["prompt_id"], [0, 0, 1, 1, 2, 2])
    assert stats["dynamic_sampling/kept_fraction"] == 1.0
    assert stats["dynamic_sampling/all_correct_fraction"] == 0.25
    assert stats["dynamic_sampling/groups_discarded"] == 1


def test_bad_generation_batches_are_rejected():
    with pytest.raises(ValueError, match="acc"):
        DynamicSampler(lambda: {"score": np.zeros(4)}, 1, G).next_batch()
    with pytest.raises(ValueError, match="multiple of"):
        DynamicSampler(lambda: {"acc": np.zeros(3, bool)}, 1, G).next_batch()
    with pytest.raises(ValueError, match="leading dim"):
        DynamicSampler(lambda: {"acc": np.zeros(4, bool), "x": np.zeros(2)}, 1, G).next_batch()
    with pytest.raises(ValueError, match="on_exhausted"):
        DynamicSampler(lambda: {}, 1, G, on_exhausted="crash")
    with pytest.raises(ValueError, match="metric must be one of"):
        DynamicSampler(lambda: {}, 1, G, metric="length")
    with pytest.raises(ValueError, match="'score'"):
        DynamicSampler(lambda: {"acc": np.zeros(4, bool)}, 1, G, metric="score").next_batch()


def test_zero_max_num_gen_batches_means_no_bound():
    # Ten all-correct batches, then one kept group per batch: 13 batches fill 3 groups.
    script = [[(1, 1), (0, 0)]] * 10 + [[(1, 0), (1, 1)]] * 3
    batch, stats = DynamicSampler(scripted(script), 3, G, max_num_gen_batches=0).next_batch()
    assert stats["dynamic_sampling/gen_batches"] == 13
    np.testing.assert_array_equal(batch["prompt_id"], [20, 20, 22, 22, 24, 24])
    assert batch["valid"].all()


def test_filter_on_score_or_reward_keeps_groups_that_differ_there():
    # Both groups are all-wrong by acc; the second differs in the shaped reward only.
    gen = {"acc": np.zeros(4, bool), "score": np.full(4, -1.0),
           "reward": np.array([-1.0, -1.0, -1.0, -1.5]), "prompt_id": np.repeat([0, 1], 2)}
    kept = lambda metric: DynamicSampler(lambda: gen, 1, G, 1, metric=metric).next_batch()[0]
    assert not kept("acc")["valid"].any() and not kept("score")["valid"].any()
    np.testing.assert_array_equal(kept("reward")["prompt_id"], [1, 1])


def test_a_group_of_one_is_kept():
    # std over one response is 0 whatever it scored; the recipe keeps such groups, and so do we.
    gen = {"acc": np.array([True, False, True])}
    batch, stats = DynamicSampler(lambda: gen, 3, 1, 1).next_batch()
    assert batch["valid"].all() and stats["dynamic_sampling/kept_fraction"] == 1.0


@pytest.mark.parametrize("q", [0.3, 0.9])
def test_prompts_consumed_matches_cost_model(q):
    """One prompt per generation batch: prompts to fill B groups ~ B/p, p = 1 - q^G - (1-q)^G."""
    group_size, groups, steps = 4, 8, 1500
    rng = np.random.default_rng(0)
    sampler = DynamicSampler(lambda: {"acc": rng.random(group_size) < q}, groups, group_size,
                             max_num_gen_batches=10_000)
    consumed = [sampler.next_batch()[1]["dynamic_sampling/prompts_consumed"] for _ in range(steps)]
    p = 1 - q**group_size - (1 - q)**group_size  # q=0.3: 0.7518, q=0.9: 0.3438
    assert np.mean(consumed) == pytest.approx(groups / p, rel=0.03)
