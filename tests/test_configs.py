"""Every config file loads, sets the paper's values, and its small variant runs one step."""

import math

import numpy as np
import pytest

from configs import ablation, dapo, grpo
from dapo_jax import metrics, programs, train

from conftest import small


@pytest.mark.parametrize("variant", sorted(dapo.VARIANTS))
def test_dapo_variants_load_with_the_papers_settings(variant):
    c = dapo.get_config(variant)
    assert (c.loss.eps_low, c.loss.eps_high, c.loss.clip_ratio_c) == (0.2, 0.28, 10.0)
    assert c.loss.agg_mode == "token-mean" and c.loss.beta == 0.0
    assert c.filter.enable and c.reward.overlong_penalty
    assert c.train.train_batch_prompts % c.train.mini_batch_prompts == 0
    if variant == "qwen2_5_32b":
        assert (c.train.train_batch_prompts, c.rollout.group_size) == (512, 16)
        assert c.train.train_batch_prompts // c.train.mini_batch_prompts == 16
        assert (c.rollout.max_new_tokens, c.reward.overlong_buffer) == (20480, 4096)
        assert (c.optim.lr, c.optim.weight_decay, c.optim.grad_clip) == (1e-6, 0.1, 1.0)
        assert (c.filter.gen_batch_prompts, c.filter.max_num_gen_batches) == (1536, 10)


def test_unknown_variant_lists_the_valid_ones():
    with pytest.raises(ValueError, match="qwen2_5_32b"):
        dapo.get_config("qwen3")


def flat(c) -> dict:
    """Every leaf of a config as {"section.key": value}."""
    return {
        f"{s}.{k}": v
        for s, section in c.to_dict().items()
        for k, v in (section.items() if isinstance(section, dict) else [("", section)])
    }


@pytest.mark.parametrize("variant", sorted(dapo.VARIANTS))
def test_grpo_is_the_baseline_and_the_ablations_first_row(variant):
    c = grpo.get_config(variant)
    assert (c.loss.eps_low, c.loss.eps_high, c.loss.clip_ratio_c) == (0.2, 0.2, 10.0)
    assert c.loss.agg_mode == "seq-mean-token-mean" and c.loss.beta == 0.0
    assert not (c.filter.enable or c.reward.overlong_penalty or c.reward.overlong_filter)
    assert (c.filter.gen_batch_prompts, c.filter.max_num_gen_batches) == (c.train.train_batch_prompts, 1)
    assert flat(c) == flat(ablation.get_config(f"naive_grpo,{variant}"))
    # Against DAPO, naive GRPO differs in exactly these keys.
    ref = flat(dapo.get_config(variant))
    assert {k for k, v in flat(c).items() if ref[k] != v} == {
        "loss.eps_high",
        "loss.agg_mode",
        "reward.overlong_penalty",
        "filter.enable",
        "filter.gen_batch_prompts",
        "filter.max_num_gen_batches",
    }


@pytest.mark.parametrize("variant", sorted(dapo.VARIANTS))
def test_ablation_rows_are_cumulative_and_end_at_dapo(variant):
    """Whole configs: each row equals the row above except in the keys the paper's row adds (the
    table's order: naive GRPO, + overlong filtering, + Clip-Higher, + soft overlong punishment
    in place of the filter, + token-level loss, + dynamic sampling at DAPO's filter sizes)."""
    ref = flat(dapo.get_config(variant))
    adds = [
        {"reward.overlong_filter": True},
        {"loss.eps_high": 0.28},
        {"reward.overlong_penalty": True, "reward.overlong_filter": False},
        {"loss.agg_mode": "token-mean"},
        {
            "filter.enable": True,
            "filter.gen_batch_prompts": ref["filter.gen_batch_prompts"],
            "filter.max_num_gen_batches": ref["filter.max_num_gen_batches"],
        },
    ]
    rows = [flat(ablation.get_config(f"{row},{variant}")) for row in ablation.ROW_NAMES]
    assert len(rows) == len(adds) + 1
    for above, row, added in zip(rows, rows[1:], adds):
        assert row == {**above, **added}
        assert all(above[k] != v for k, v in added.items())  # each added key changes its value
    assert rows[-1] == ref  # (rows[0] is naive GRPO: the test above)


def test_unknown_ablation_row_lists_the_valid_ones():
    with pytest.raises(ValueError, match="clip_higher"):
        ablation.get_config("clip_highr,tiny")


def test_warm_up_counts_rollout_steps_and_the_first_update_learns():
    c = dapo.get_config("qwen2_5_32b")
    assert c.optim.warmup_rollout_steps == 20
    schedule = programs.learning_rate_schedule(c)  # 16 updates a rollout step: 320 warm-up updates
    lr = [float(schedule(s)) for s in (0, 1, 15, 318, 319, 320, 5000)]
    np.testing.assert_allclose(
        lr, [1e-6 / 320, 2e-6 / 320, 16e-6 / 320, 319e-6 / 320, 1e-6, 1e-6, 1e-6], rtol=1e-6
    )
    c.optim.warmup_rollout_steps = 0
    assert float(programs.learning_rate_schedule(c)(0)) == pytest.approx(1e-6)


# The config runs reduced to the distinct code paths of one RL step; the tests above prove that
# every other config (the ablation rows, configs/dapo.py's and configs/grpo.py's other variants)
# is one of these with other values: Clip-Higher and the soft overlong penalty change numbers
# only, and overlong filtering is the host mask pinned in test_train.py.
#   dapo:    dynamic sampling over several generation batches, token-mean, shaped rewards, no
#            reference model (β = 0);
#   grpo_kl: configs/grpo.py with β > 0: no filter (one generation batch, all-equal groups
#            kept), seq-mean-token-mean, the reference model loaded and its log-probs in the loss.
# (configs/grpo.py at β = 0 adds no path: its reference-free loss is dapo's.)
@pytest.mark.slow
@pytest.mark.parametrize(
    "name,config",
    [
        ("dapo", lambda: dapo.get_config("tiny")),
        (
            "grpo_kl",
            lambda: small(  # also samples with bf16 weights on a data x tensor mesh of their own
                grpo.get_config("tiny"),
                loss__beta=0.001,
                reference__path=dapo.get_config("tiny").model.path,
                mesh__tensor=2,
                rollout__param_dtype="bfloat16",  # (seq-mean-token-mean, pi_ref packed too)
            ),
        ),
    ],
)
def test_small_variant_runs_one_step(name, config, tmp_path):
    summary = train.train(small(config()), str(tmp_path))
    assert summary["actor/skipped_updates"] == 0
    assert math.isfinite(summary["actor/pg_loss"]) and summary["actor/grad_norm"] > 0
    if name == "grpo_kl":
        assert summary["dynamic_sampling/gen_batches"] == 1 and summary["actor/kl_ref"] >= 0
        assert 1e-4 < summary["rollout/logp_diff_max"] < 0.5  # bf16 sampler against the f32 trainer
    else:
        assert "actor/kl_ref" not in summary
    records = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1]
    assert (tmp_path / "export" / "model.safetensors").exists()
    assert (tmp_path / "export" / "tokenizer.json").exists()
