"""Every config file loads, sets the paper's values, and its small variant runs one step."""

import math

import pytest

from configs import ablation, dapo, grpo
from conftest import small
from dapo_jax import metrics, train


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


def test_grpo_is_the_baseline():
    c = grpo.get_config("tiny")
    assert (c.loss.eps_low, c.loss.eps_high) == (0.2, 0.2)
    assert c.loss.agg_mode == "seq-mean-token-mean" and c.loss.beta > 0
    assert not (c.filter.enable or c.reward.overlong_penalty or c.reward.overlong_filter)


def test_ablation_rows_are_cumulative_and_end_at_dapo():
    rows = [ablation.get_config(f"{row},tiny") for row in ablation.ROW_NAMES]
    assert [r.reward.overlong_filter for r in rows] == [False] + [True] * 5
    assert [r.loss.eps_high for r in rows] == [0.2, 0.2] + [0.28] * 4
    assert [r.reward.overlong_penalty for r in rows] == [False] * 3 + [True] * 3
    assert [r.loss.agg_mode == "token-mean" for r in rows] == [False] * 4 + [True] * 2
    assert [r.filter.enable for r in rows] == [False] * 5 + [True]
    full, ref = rows[-1], dapo.get_config("tiny")
    for section in ("loss",):
        assert full[section].to_dict() == ref[section].to_dict()
    with pytest.raises(ValueError, match="clip_higher"):
        ablation.get_config("clip_highr,tiny")


@pytest.mark.parametrize("name,config", [
    ("dapo", lambda: dapo.get_config("tiny")),
    ("grpo", lambda: grpo.get_config("tiny")),
] + [(row, lambda row=row: ablation.get_config(f"{row},tiny")) for row in ablation.ROW_NAMES])
def test_small_variant_runs_one_step(name, config, tmp_path):
    summary = train.train(small(config()), str(tmp_path))
    assert summary["actor/skipped_updates"] == 0
    assert math.isfinite(summary["actor/pg_loss"]) and summary["actor/grad_norm"] > 0
    if name == "grpo":
        assert summary["actor/kl_ref"] >= 0 and summary["dynamic_sampling/gen_batches"] == 1
    records = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1]
    assert (tmp_path / "export" / "model.safetensors").exists()
    assert (tmp_path / "export" / "tokenizer.json").exists()
