"""The rollout engine (continuous batching over a paged KV cache) against the fixed batch: the
same tokens, log-probs, lengths and ends, whatever the slots, pages and pool size."""

import dataclasses
import re

import jax
import numpy as np
import pytest
from test_sampler import _config, _load, _prompts

from dapo_jax import decoding, engine, sampler, sharding


@pytest.fixture(scope="module")
def single():
    return sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])


def _generate(m, params, cfg, mesh, prompt, mask, group, key, uids):
    s = sampler.Sampler(m, cfg, mesh)
    return jax.device_get(s.generate(params, prompt, mask, group, key, uids_P=uids))


def _assert_same_rows(out, ref, what):
    for k in ("tokens_BxN", "length_B", "truncated_B", "mask_BxN"):
        np.testing.assert_array_equal(getattr(out, k), getattr(ref, k), err_msg=f"{k}, {what}")
    np.testing.assert_allclose(out.logp_BxN, ref.logp_BxN, atol=2e-6, err_msg=what)


@pytest.mark.parametrize(
    "scan_layers, transposed_keys", [(False, False), pytest.param(True, True, marks=pytest.mark.slow)]
)
def test_engine_equals_the_fixed_batch(qwen2_dir, single, scan_layers, transposed_keys):
    """Prompts of 8, 3, 6, 1 and 5 tokens (full, partial and no shared pages at Z = 4), rows that
    end and rows truncated: with 1, 4 and 64 slots and pages of 4 and 16, every row as the fixed
    batch's."""
    m, params = _load(qwen2_dir, single, scan_layers=scan_layers, transposed_keys=transposed_keys)
    prompt, mask = _prompts([8, 3, 6, 1, 5], 8, seed=8)
    cfg = _config(eos_ids=tuple(range(3, 11)), temperature=0.8, top_k=40)
    args = (prompt, mask, 3, jax.random.key(5), [4, 1, 7, 2, 9])
    fixed = _generate(m, params, cfg, single, *args)
    assert fixed.truncated_B.any() and len(set(fixed.length_B[~fixed.truncated_B].tolist())) > 3
    for slots, page in ((1, 4), (4, 1), (64, 16))[: 3 if scan_layers else 2]:
        paged = dataclasses.replace(cfg, paged=True, decode_slots=slots, page_size=page)
        _assert_same_rows(
            _generate(m, params, paged, single, *args), fixed, f"{slots} slots, pages of {page}"
        )


@pytest.mark.parametrize("pages", [32, pytest.param(17, marks=pytest.mark.slow)])
def test_a_pool_a_quarter_of_rows_times_length_completes_the_batch(qwen2_dir, single, pages):
    """16 rows of up to 8 + 24 keys (8 pages of 4 each, 128 pages in all) in a pool of 32 pages,
    8 of them the prompts', or in the smallest pool allowed (17): rows wait for pages (and in the
    smallest, give theirs back), and every row still gets the fixed batch's tokens and log-probs."""
    m, params = _load(qwen2_dir, single)
    prompt, mask = _prompts([8, 3, 6, 5], 8, seed=3)
    uids, key = np.arange(4, dtype=np.int32), jax.random.key(2)
    cfg = _config(max_new_tokens=24)  # no end id: every row holds 8 pages at its end
    fixed = _generate(m, params, cfg, single, prompt, mask, 4, key, uids)
    u_BxN = decoding.row_uniforms(key, uids, 4, 24)
    paged = dataclasses.replace(cfg, paged=True, decode_slots=8, page_size=4, kv_pages=pages)
    geo = engine.geometry(paged, 4, 4, 8)
    assert geo.rows * geo.table_pages >= 4 * geo.pool_pages
    run = jax.jit(lambda p, x, k, u: engine.paged_rollout(m, paged, 4, p, x, k, u))
    out, stats = jax.device_get(run(params, prompt, mask, u_BxN))
    _assert_same_rows(out, fixed, f"{pages} pages")
    assert stats["waits"] > 0 and (pages > 17 or stats["preemptions"] > 0), stats
    with pytest.raises(ValueError, match="kv_pages = 16 cannot hold"):
        engine.geometry(dataclasses.replace(paged, kv_pages=16), 4, 4, 8)


def test_a_loop_per_data_shard_with_tensor_parallel_inside_equals_one_device(qwen2_dir, single):
    """On a data 2 x tensor 2 mesh the engine runs one loop per data shard (shard_map over data
    only; the weights split over tensor inside): every row as one device's fixed batch (3 prompts
    filled up to 4), and the loop's collectives stay within a data shard's tensor pair."""
    m, params = _load(qwen2_dir, single)
    prompt, mask = _prompts([8, 3, 6], 8, seed=9)
    cfg = _config(eos_ids=tuple(range(3, 11)), temperature=0.8)
    key, uids = jax.random.key(6), [4, 1, 7]
    ref = _generate(m, params, cfg, single, prompt, mask, 2, key, uids)
    assert ref.truncated_B.any() and not ref.truncated_B.all()
    mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 2}, devices=jax.devices()[:4])
    _, mesh_params = _load(qwen2_dir, mesh)
    s = sampler.Sampler(m, dataclasses.replace(cfg, paged=True, decode_slots=4, page_size=4), mesh)
    with sharding.activate(mesh):
        args = (mesh_params, prompt[:2], mask[:2], np.asarray(uids[:2], np.int32), key)
        hlo = s._rollout_fn(2).lower(*args).compile().as_text()
    groups = set(re.findall(r"replica_groups=(\[[\d,]+\]<=\[\d+\]|\{[\d,{}]*\})", hlo))
    assert groups and "collective-permute" not in hlo and groups <= {"[2,2]<=[4]", "{{0,1},{2,3}}"}, groups
    out = jax.device_get(s.generate(mesh_params, prompt, mask, 2, key, uids_P=uids))
    _assert_same_rows(out, ref, "data 2 x tensor 2")


@pytest.mark.parametrize(
    "prompts, group, slots, want",
    [(192, 16, 64, 4), (6, 4, 16, 3), (5, 3, 4, 1), (5, 3, None, 5), (7, 2, 6, 1), (4, 4, 8, 2)],
)
def test_prefill_chunks_are_the_prompts_that_fill_the_slots(prompts, group, slots, want):
    """The prefill's chunk by hand: the largest divisor of P up to ceil(S / G) (S None: every row),
    e.g. 192 prompts of G = 16 in 64 slots: 4 a chunk; 6 prompts of 4 in 16 slots: 3 (4 does not
    divide 6); 7 prompts, 3 wanted: 1."""
    cfg = _config(max_new_tokens=8, paged=True, decode_slots=slots, page_size=4)
    assert engine.geometry(cfg, prompts, group, 8).prefill_prompts == want
