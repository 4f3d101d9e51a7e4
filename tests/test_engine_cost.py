"""The engine's per-step HBM count (`engine_cost.engine_count`) against counts by hand, and its
programs compiled on fake CPU devices."""

import json
import os
import subprocess
import sys

import pytest

from dapo_jax import engine_cost, hf_model_config, known_models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN_32B = hf_model_config.config_from_hf(known_models.KNOWN_MODELS["Qwen2.5-32B"], dtype="bfloat16")


def test_steps_and_pages_by_hand():
    """Pages of 4 slots. Row 0: a prompt of 3, 2 response steps holding 3 and 4 keys (1 page
    each); row 1: a prompt of 5, 6 steps holding 5..10 keys (2, 2, 2, 2, 3, 3 pages): 16 pairs.
    One slot runs the rows one after the other (8 steps); two slots side by side (6). The
    kernel's blocks of 2 pages (8 keys): row 0 one block a step (2 blocks), row 1 one block at 5..8
    keys and two at 9, 10 (8 blocks): 10 blocks, 20 pages fetched; blocks of one page: the pairs."""
    for slots, steps in ((1, 8), (2, 6), (3, 6)):
        count = engine_cost.engine_count(QWEN_32B, 8, [3, 5], [2, 6], 4, slots, 2)
        assert (count.steps, count.tokens, count.pairs, count.kernel_pairs) == (steps, 8, 16, 20)
    assert engine_cost.engine_count(QWEN_32B, 8, [3, 5], [2, 6], 4, 1, 1).kernel_pairs == 16


def test_a_row_takes_the_slot_that_frees_first():
    """Responses of 5, 2 and 4 in two slots: row 2 starts when row 1 ends (step 2), ends at 6."""
    assert engine_cost.engine_count(QWEN_32B, 8, [1, 1, 1], [5, 2, 4], 16, 2, 1).steps == 6


def test_qwen2_5_32b_bytes_by_hand():
    """Per chip of 8: the bf16 weights but the embedding table, 64 layers of q/k/v/o (40 query
    and 8 KV heads of 128 over 5120, q/k/v biases), the MLP (3 x 5120 x 27648), two norms, the
    final norm and the LM head (152064 x 5120); a page of 16 slots x 2 x 8 heads x 128 x 2 B x
    64 layers / 8 = 512 KiB. The mean step reads the weights and pairs / steps pages: the rows'
    8 steps hold at most 10 keys, one page each, over 6 steps in two slots."""
    d, f, v = 5120, 27648, 152064
    layer = d * 128 * (40 + 8 + 8 + 40) + 128 * (40 + 8 + 8) + 3 * d * f + 2 * d
    weights = (64 * layer + d + v * d) * 2 / 8
    count = engine_cost.engine_count(QWEN_32B, 8, [3, 5], [2, 6], 16, 2, 1)
    assert count.weight_bytes == weights
    assert count.page_bytes == 512 * 2**10
    assert count.pairs == 8 and count.bytes_per_step == weights + 8 * 2**19 / 6


_HLO = """HloModule m

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %sum = bf16[] add(%a, %b)
}

%fused_write (p0: bf16[1024,2,128], p1: s32[4,1], p2: bf16[4,2,128]) -> bf16[1024,2,128] {
  %p0 = bf16[1024,2,128]{2,1,0:T(2,128)(2,1)} parameter(0)
  %p1 = s32[4,1]{1,0} parameter(1)
  %p2 = bf16[4,2,128]{2,1,0} parameter(2)
  %scatter.1 = bf16[1024,2,128]{2,1,0:T(2,128)(2,1)} scatter(%p0, %p1, %p2), to_apply=%add
  ROOT %bitcast.1 = bf16[1024,2,128]{2,1,0:T(2,128)(2,1)} bitcast(%scatter.1)
}

%fused_lookup (q0: bf16[1000,64], q1: s32[8,1]) -> f32[8,64] {
  %q0 = bf16[1000,64]{1,0} parameter(0)
  %q1 = s32[8,1]{1,0} parameter(1)
  %gather.1 = bf16[8,64]{1,0} gather(%q0, %q1), offset_dims={1}, slice_sizes={1,64}
  ROOT %convert.1 = f32[8,64]{1,0} convert(%gather.1)
}

ENTRY %main (pool: bf16[1024,2,128], idx: s32[4,1], kv: bf16[4,2,128], table: bf16[1000,64]) -> f32[8,256] {
  %pool = bf16[1024,2,128]{2,1,0:T(2,128)(2,1)} parameter(0)
  %idx = s32[4,1]{1,0} parameter(1)
  %kv = bf16[4,2,128]{2,1,0} parameter(2)
  %table = bf16[1000,64]{1,0} parameter(3)
  %rows = s32[8,1]{1,0} parameter(4)
  %w = f32[64,256]{1,0} parameter(5)
  %copy-start = (f32[64,256]{1,0:T(8,128)S(1)}, f32[64,256]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%w)
  %write = bf16[1024,2,128]{2,1,0:T(2,128)(2,1)} fusion(%pool, %idx, %kv), kind=kCustom, calls=%fused_write
  %lookup = f32[8,64]{1,0} fusion(%table, %rows), kind=kLoop, calls=%fused_lookup
  %copy-done = f32[64,256]{1,0:T(8,128)S(1)} copy-done(%copy-start)
  %dot.1 = f32[8,256]{1,0} dot(%lookup, %copy-done), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %kernel = bf16[4,2,128]{2,1,0} custom-call(%idx, %write), custom_call_target="tpu_custom_call"
  ROOT %out = (f32[8,256]{1,0}, bf16[4,2,128]{2,1,0}) tuple(%dot.1, %kernel)
}
"""


def test_hbm_bytes_of_an_hlo_by_hand():
    """The weight's prefetch into VMEM reads its 64 x 256 x 4 B once; the write updates the pool
    in place (its 4 indices and 4 x 2 x 128 bf16 updates, read and written: 2 x 2,064); the
    lookup reads 8 indices and writes 8 x 64 f32, not the table (2,080); the dot reads that and
    the weight in VMEM (nothing) and writes 8 x 256 f32 (2,048 + 8,192); the kernel reads its
    query and writes its output (2 x 2,048); the reducer, parameters and tuple move nothing."""
    want = 64 * 256 * 4 + 2 * 2064 + 2080 + (2048 + 8192) + 2 * 2048
    assert engine_cost.hbm_bytes(_HLO) == want == 86080


@pytest.mark.slow
def test_the_engine_programs_compile_on_cpu_devices():
    """`--programs=engine` on the tiny config, rollout on data 4 x tensor 2 in bf16: the whole
    engine program and its prefill fit, the step's bytes grow with its layers, and the count's
    steps take at least the tokens / slots."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dapo_jax.aot",
            "--config=configs/dapo.py:tiny",
            "--topology=cpu:8",
            "--programs=engine",
            "--config.mesh.tensor=2",
            "--config.rollout.param_dtype=bfloat16",
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    engine, prefill, step = json.loads(out.stdout.strip().splitlines()[-1])
    assert [engine["program"], prefill["program"]] == ["engine", "engine_prefill"]
    for r in (engine, prefill):
        assert 0 < r["total_gib"] < r["hbm_gib"] and r["resident_gib"] > 0  # the train state beside
    assert step["program"] == "engine_step" and step["steps"] >= step["tokens"] / step["slots"]
    assert (
        0 < step["roofline_step_gib"] and step["step_bytes_1_2_layers"][1] > step["step_bytes_1_2_layers"][0]
    )
