"""The tools around a run, on one tiny trained workdir: a user's reward plug-in scores the run,
wandb (offline) logs beside JSONL and TensorBoard, a profiled step leaves its trace, the console
line reads emitted keys; evaluate a checkpoint or a model folder (every sample written), export
any checkpoint step."""

import dataclasses
import glob
import importlib.util
import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import traverse_util
from safetensors.numpy import load_file

from configs import dapo
from dapo_jax import config_checks, evaluate, evaluation, export, hf_io, math_answers, metrics, sampler, train
from dapo_jax.errors import ConfigError

from conftest import small

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_WANDB = importlib.util.find_spec("wandb") is not None


def _config(**overrides):
    return small(dapo.get_config("tiny"), **overrides)


# A user's reward: a constant score (so that the run's mean score shows it was used), correct
# on an even response length (so that groups are mixed), and it raises unless it gets the row's
# data_source and extra_info (so that a missing context shows as reward errors).
USER_REWARD = """
def score(response, ground_truth, *, data_source, extra_info):
    if data_source != "synthetic_arith" or "solution" not in extra_info:
        raise ValueError(f"no context: {data_source!r} {extra_info!r}")
    return {"score": 0.25, "acc": len(response) % 2 == 0, "pred": response[-3:]}
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny run of two steps with a checkpoint after each, scored by USER_REWARD."""
    path = tmp_path_factory.mktemp("run")
    (path / "user_reward.py").write_text(USER_REWARD)
    writers = "jsonl,tensorboard" + (",wandb" if HAVE_WANDB else "")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        train.train(
            _config(
                train__steps=2,
                reward__fn=f"{path}/user_reward.py:score",
                metrics__writers=writers,
                metrics__aliases=True,
                profile__steps="2",
                metrics__completions_every=1,
                metrics__completions_rows=2,
                metrics__completions_chars=None,
            ),
            str(path),
        )
    return str(path)


@pytest.mark.slow
def test_completion_tables_show_what_the_reward_saw(workdir):
    records = metrics.read_jsonl(os.path.join(workdir, metrics.COMPLETIONS))
    assert [r["step"] for r in records] == [1, 1, 2, 2]  # every step, two rows each
    for r in records:  # USER_REWARD's verdicts, recomputed from the logged response
        assert r["score"] == 0.25 and r["pred"] == r["response"][-3:]
        assert r["acc"] == (len(r["response"]) % 2 == 0)
        assert r["prompt"] and r["ground_truth"] and r["length"] >= 1
    for step in (1, 2):  # the first response of two different groups
        assert len({r["problem_id"] for r in records if r["step"] == step}) == 2


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_WANDB, reason="wandb is not installed (pip install -e .[tracking])")
def test_wandb_offline_logs_under_the_recipes_names(workdir):
    run_id = open(os.path.join(workdir, "wandb_run_id")).read().strip()
    (log,) = glob.glob(os.path.join(workdir, "wandb", f"offline-run-*-{run_id}", f"run-{run_id}.wandb"))
    history = open(log, "rb").read()  # protobuf records: the metric names are plain bytes
    for name in (
        "critic/score/mean",
        "response_length/mean",
        "actor/entropy",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_eps_low",
        "train/num_gen_batches",
        "dynamic_sampling/kept_fraction",
    ):
        assert name.encode() in history, name
    assert b"data/score_mean" not in history  # aliased: logged under the recipe's name only
    assert os.listdir(os.path.join(workdir, "tensorboard"))


@pytest.mark.slow
def test_a_profiled_step_leaves_its_trace(workdir):
    assert os.listdir(os.path.join(workdir, "profile")) == ["step_2"]
    traces = glob.glob(os.path.join(workdir, "profile", "step_2", "**", "*.xplane.pb"), recursive=True)
    assert traces and os.path.getsize(traces[0]) > 0


@pytest.mark.slow
def test_every_key_of_the_console_line_is_emitted(workdir):
    records = metrics.read_jsonl(os.path.join(workdir, metrics.JSONL))
    emitted = set().union(*records)
    assert [key for key, _, _ in metrics.CONSOLE if key not in emitted] == []
    line = metrics.console_line(2, records[-1])
    assert all(f"  {label} " in line for _, label, _ in metrics.CONSOLE)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("writers", "jsonl,mlflow", "metrics.writers 'jsonl,mlflow': a comma-separated list of"),
        ("writers", "tensorboard", "that includes jsonl"),
        ("steps", "3,x", "profile.steps '3,x': comma-separated step numbers >= 1"),
    ],
)
def test_bad_tracking_keys_are_one_line(key, value, message):
    c = _config()
    (c.metrics if key == "writers" else c.profile)[key] = value
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_checks.check_config(c)


@pytest.mark.slow
def test_a_user_reward_from_a_file_scores_the_run(workdir):
    records = metrics.read_jsonl(os.path.join(workdir, metrics.JSONL))
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["before_filter/score_mean"] == 0.25 and r["data/score_mean"] == 0.25
        assert r["reward/errors_total"] == 0 and r["reward/timeouts_total"] == 0
        assert 0 < r["before_filter/acc_mean"] < 1


@pytest.mark.slow
def test_evaluate_a_checkpoint_writes_every_sample(workdir):
    c = evaluate.apply_overrides(_config(), samples=2, temperature=1.0, top_p=1.0)
    result, out = evaluate.evaluate(c, workdir=workdir, step=1)
    assert out == os.path.join(workdir, "eval_step_1")
    rows = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    assert len(rows) == 8 * 2 and {r["sample"] for r in rows} == {0, 1}
    for row in rows:  # every row's score is the reward of its own response, recomputed here
        expected = math_answers.math_dapo_score(row["response"], row["ground_truth"])
        assert (row["score"], row["acc"], row["pred"]) == (
            expected["score"],
            expected["acc"],
            expected["pred"],
        )
        assert row["truncated"] == (row["length"] == 40) or row["length"] < 40
        assert row["prompt"] and isinstance(row["length"], int)
    by_problem = {}
    for row in rows:
        by_problem.setdefault(row["problem_id"], []).append(row["acc"])
    per_problem = [np.mean(a) for a in by_problem.values()]
    assert result["eval/avg@2"] == pytest.approx(np.mean(per_problem))
    assert result["eval/se_avg@2"] == pytest.approx(np.std(per_problem, ddof=1) / np.sqrt(8))
    assert result["eval/pass@2"] == pytest.approx(np.mean([max(a) for a in by_problem.values()]))
    assert {"eval/pass@1", "eval/maj@1", "eval/maj@2", "eval/se_pass@2", "eval/se_maj@2"} <= set(result)
    assert json.load(open(os.path.join(out, "metrics.json")))["step"] == 1
    assert "avg@2 " in evaluation.summary_text(result) and "± " in evaluation.summary_text(result)


@pytest.mark.slow
def test_export_any_step_and_evaluate_the_folder_from_the_command_line(workdir, tmp_path):
    out, step = export.export(_config(), workdir, step=1, out=str(tmp_path / "hf"), dtype="bfloat16")
    assert step == 1
    hf_io.check_model_folder(out)
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    run, state, _ = export.restore(_config(), workdir, 1)
    run.scorer.close()
    weights = load_file(os.path.join(out, "model.safetensors"))
    flat = traverse_util.flatten_dict(state.params)
    assert len(weights) == len(flat)
    for path, x in flat.items():  # step 1's weights, not the newest (step 2) ones
        name, transposed = hf_io.hf_name(path)
        x = np.asarray(x).astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(weights[name], x.T if transposed else x)
    cmd = [
        sys.executable,
        "-m",
        "dapo_jax.evaluate",
        "--config=configs/dapo.py:tiny",
        f"--model={out}",
        f"--out={tmp_path / 'eval'}",
        "--samples=2",
        "--top_p=0.9",
        "--max_new_tokens=24",
        "--config.eval.max_problems=4",
        "--config.eval.batch_prompts=4",
        "--config.reward.num_workers=1",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "4 problems x 2 samples: avg@2 " in done.stdout
    rows = [json.loads(line) for line in open(tmp_path / "eval" / "samples.jsonl")]
    assert len(rows) == 8 and all(r["length"] <= 24 for r in rows)


@pytest.mark.slow
def test_exported_model_decodes_our_greedy_tokens_in_transformers(workdir, tmp_path):
    """A trained step's export, read by transformers alone, decodes greedily the tokens our
    sampler decodes greedily from that step's weights. (The tokenizer is read as the fast
    tokenizer it was saved as: transformers 5's AutoTokenizer forces Qwen2Tokenizer on a qwen2
    config.json and drops the tiny character tokenizer's spaces, `hf_io.load_tokenizer`.)"""
    import torch  # noqa: PLC0415 - the reference implementation (test extra)
    import transformers  # noqa: PLC0415

    out, _ = export.export(_config(), workdir, step=2, out=str(tmp_path / "hf"), dtype="float32")
    built, state, _ = export.restore(_config(), workdir, 2)
    built.scorer.close()
    problems = [ex["prompt_text"] for ex in built.eval_examples[:3]]
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in problems]
    assert ids == [ex["prompt_ids"] for ex in built.eval_examples[:3]]  # the run's own prompt ids
    width, n_new = max(map(len, ids)), 24
    prompt = np.array([[0] * (width - len(x)) + x for x in ids], np.int32)
    mask = np.arange(width)[None] >= width - np.array([len(x) for x in ids])[:, None]
    greedy = dataclasses.replace(built.eval_sampler.config, greedy=True, max_new_tokens=n_new)
    ours = sampler.Sampler(built.model, greedy, built.mesh).generate(
        state.params, prompt, mask, 1, jax.random.key(0)
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    done = hf.generate(
        input_ids=torch.tensor(prompt, dtype=torch.long),
        attention_mask=torch.tensor(mask, dtype=torch.long),
        max_new_tokens=n_new,
        do_sample=False,
        pad_token_id=greedy.pad_id,
    )[:, width:].numpy()
    tokens, lengths = np.asarray(ours.tokens_BxN), np.asarray(ours.length_B)
    assert lengths.min() > 3  # something was decoded
    for row in range(3):  # transformers stops a row at EOS and pads it when others go on
        np.testing.assert_array_equal(done[row, : lengths[row]], tokens[row, : lengths[row]])


@pytest.mark.slow
def test_export_of_a_missing_step_is_one_line_naming_the_steps(workdir, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "dapo_jax.export",
        "--config=configs/dapo.py:tiny",
        f"--workdir={workdir}",
        "--step=7",
        f"--out={tmp_path / 'x'}",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert done.returncode == 2 and errors == [
        f"error: workdir {workdir!r} has no checkpoint of step 7; its steps: [1, 2]"
    ]
    assert not os.path.exists(tmp_path / "x")
