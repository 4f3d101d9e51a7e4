"""experiments/bench_peers.py: its arithmetic by hand, its workload, and (slow) our runner end to
end with tiny arguments. The peers' virtualenvs are not needed."""

import json
import os
import subprocess
import sys

import pytest

from dapo_jax import hf_model_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "experiments"))
sys.path.insert(0, os.path.join(REPO, "experiments", "peers"))
import bench_peers  # noqa: E402
import make_tiny_model  # noqa: E402
import workload  # noqa: E402

UNIT = {  # every size 1: a layer has q 1+1, k and v 2 x (1+1), o 1, MLP 3, norms 2 = 12
    "hidden_size": 1,
    "intermediate_size": 1,
    "vocab_size": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 1,
    "num_hidden_layers": 1,
}


def test_the_workload_model_has_the_parameters_dapo_jax_counts():
    hf = workload.HF_CONFIG
    assert bench_peers.num_params(hf) == 1_018_496
    assert bench_peers.num_params(hf) == hf_model_config.config_from_hf(hf, dtype="float32").num_params()


def test_step_flops_by_hand():
    # 12 + embedding 1 + head 1 + final norm 1 = 15 parameters, 14 in matmuls
    assert bench_peers.num_params(UNIT) == 15
    assert bench_peers.token_flops(UNIT, 14, 3.0) == 28 + 4 * 3
    gen, upd = bench_peers.step_flops(UNIT, prompts=1, group=2, prompt_len=2, response=2.0)
    assert gen == 1 * 2 * (28 + 4 * 1) + 2 * 2 * (28 + 4 * 3)  # prefill once, decode 2 rows
    assert upd == 3 * 2 * 4 * (28 + 4 * 2)


def test_prompts_are_distinct_and_of_one_length():
    prompts = workload.prompts(8)
    assert len(set(prompts)) == 8
    assert {len(p) for p in prompts} == {18}


def test_reward_is_the_share_of_digits():
    assert workload.digit_fraction("a1b2") == 0.5
    assert workload.digit_fraction("") == 0.0
    assert workload.char_reward("123", "x", data_source="", extra_info=None) == 1.0
    assert workload.reward(["p", "q"], ["a1b2", "xy"], completion_ids=None) == [0.5, 0.0]


def test_the_tokenizer_round_trip_check_catches_dropped_spaces():
    class SpaceDropper:
        def encode(self, text, add_special_tokens=False):
            return [ord(ch) for ch in text if ch != " "]

        def decode(self, ids):
            return "".join(map(chr, ids))

    with pytest.raises(SystemExit, match="round trip"):
        workload.check_round_trip(SpaceDropper())
    workload.check_round_trip(make_tiny_model.build_tokenizer())


@pytest.mark.slow
def test_our_runner_end_to_end(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, os.path.join(REPO, "experiments", "bench_peers.py"), "--impls", "ours"]
    cmd += ["--steps", "1", "--warmup", "0", "--max_new_tokens", "8", "--prompts", "2", "--group_size", "2"]
    cmd += ["--json_out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the real device, not 8 fakes
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, check=False)
    assert proc.returncode == 0 and "ours FAILED" not in proc.stdout, proc.stdout + proc.stderr
    ours = json.loads(out.read_text())["results"]["ours"]
    assert len(ours["steps"]) == 1
    assert 0 < ours["tokens"] <= 2 * 2 * 8
    assert ours["gen_s"] > 0 and ours["update_s"] > 0
    assert ours["settings"]["matmul_gflops"] > 0
    assert "roofline" in proc.stdout


def test_step_timer_splits_a_step_into_generation_and_update():
    timer = workload.StepTimer()
    ready = []
    generate = timer.wrap_generation(lambda n: [1] * n, tokens=len, ready=ready.append)

    def step(n):
        generate(n)
        generate(2)
        return "done"

    timed_step = timer.wrap_step(step, ready=lambda: ready.append("step"))
    assert timed_step(3) == "done"
    assert timed_step(1) == "done"
    assert ready == [[1, 1, 1], [1, 1], "step", [1], [1, 1], "step"]
    assert [s["tokens"] for s in timer.steps] == [5, 3]
    for s in timer.steps:
        assert set(s) == {"step_s", "gen_s", "update_s", "tokens"}
        assert 0 <= s["gen_s"] <= s["step_s"]
        assert s["update_s"] == s["step_s"] - s["gen_s"]
