"""The rollout engine: continuous batching over a paged KV cache, in one jitted loop.

A generation batch of B = P x G rows (row p*G + g: response g to prompt p) is decoded in S slots
(`SamplingConfig.decode_slots`). Each layer's cache is a pool of M pages of Z slots
(`paged_attention`; M = `kv_pages`, Z = `page_size`), the L layers' pools one array
`pool_AxZxUxE` (A = L x M; a page id p names page p of every layer), which every step updates
in place. Row b's keys are its prompt's q_p real tokens then its own, in order (no padding
held): key s in slot s % Z of page `table[s // Z]`.

- Prefill: once per prompt (its first q_p - 1 tokens), into the prompt's J = ceil((Q - 1) / Z)
  pages, held for the whole call; in chunks of about S / G prompts, so that a call may hold a
  whole generation batch. The prompt's full pages are shared by its G rows (their tables
  name them); its last, partial page is copied into a page of the row's own when the row starts.
- Decode: every step each running row feeds one token (its prompt's last at t = 0, then its
  token t - 1) at position q_p - 1 + t, takes a page from the free list when that key starts
  one, and attends over only the pages it holds (`paged_attention.decode_step`: the Pallas
  kernel on TPU). A row ends at an end id or after N tokens; its slot and own pages are freed
  at once and the next waiting row starts.
- A full pool: a row needing a page when none is free waits (its step is not taken). If every
  running row waits, the one started last gives its pages back and waits to start again; it
  recomputes the same tokens, since a row's samples depend only on its uniforms. New rows start
  only while one free page is left per running row. Nothing is truncated: a batch completes
  whenever the pool holds the prompts' pages and one row at N tokens.

Tokens and log-probs are the fixed batch's (`sampler`), to float rounding of the attention sums:
the same per-row uniforms u_BxN and the same sampling.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from dapo_jax import decoding
from dapo_jax.model import KVCache, ModelConfig, Transformer
from dapo_jax.paged_attention import PageRefs, interleave_kv


class Geometry(NamedTuple):
    """Static sizes of one engine program."""

    rows: int  # B
    slots: int  # S
    page_size: int  # Z
    prompt_pages: int  # J, pages per prompt (P x J held from the start)
    table_pages: int  # I, pages a row may hold: ceil((Q - 1 + N) / Z)
    pool_pages: int  # M
    prefill_prompts: int  # prompts a prefill chunk: the largest divisor of P up to ceil(S / G)


def geometry(config: decoding.SamplingConfig, prompts: int, group: int, width: int) -> Geometry:
    """The engine's sizes for P = `prompts` of bucket width Q = `width`, G = `group`; M is
    `config.kv_pages`, or (None) enough for every slot at N tokens and a spare each; at least
    the prompts' pages, one row's at N tokens and one spare."""
    z, b = config.page_size, prompts * group
    s = min(config.decode_slots or b, b)
    j, i = -(-(width - 1) // z), -(-(width - 1 + config.max_new_tokens) // z)
    m, least = config.kv_pages or prompts * j + s * (i + 1), prompts * j + i + 1
    if m < least:
        raise ValueError(
            f"kv_pages = {m} cannot hold the {prompts} prompts' {prompts * j} pages, one row at "
            f"{config.max_new_tokens} tokens ({i} pages of {z}) and a spare: set kv_pages >= {least}"
        )
    chunk = max(d for d in range(1, min(-(-s // group), prompts) + 1) if prompts % d == 0)
    return Geometry(b, s, z, j, i, m, chunk)


def empty_pool(config: ModelConfig, pages: int, page_size: int):
    """The zeroed pool `pool_AxZxUxE` of every layer's M = `pages` pages (A = L x M) in the
    compute dtype, its combined heads split over `tensor` as the weights' kv heads are."""
    shape = (config.num_layers * pages, page_size, 2 * config.num_kv_heads, config.head_dim)
    return _heads_split(jnp.zeros(shape, config.compute_dtype))


def _heads_split(pool_AxZxUxE):
    return nn.with_logical_constraint(pool_AxZxUxE, (None, None, "kv_heads", None))


def _as_pages(cache: KVCache, pad_P, geo: Geometry, transposed_keys: bool):
    """`kv_AxZxUxE`: one layer's left-padded prefill cache (Q - 1 slots) as the P prompts' J pages
    each (A = P x J), prompt p's real tokens first (shifted left by its padding `pad_P`)."""
    k_PxKxSxE = cache.k.swapaxes(2, 3) if transposed_keys else cache.k
    p, k, s, e = k_PxKxSxE.shape
    keys = geo.prompt_pages * geo.page_size
    src_PxS = jnp.minimum(jnp.arange(keys)[None] + pad_P[:, None], s - 1)
    take = lambda x: jnp.take_along_axis(x, src_PxS[:, None, :, None], axis=2).transpose(0, 2, 1, 3)
    kv_PxSxUxE = jax.vmap(interleave_kv)(take(k_PxKxSxE), take(cache.v))
    return kv_PxSxUxE.reshape(p * geo.prompt_pages, geo.page_size, 2 * k, e)


def prefill_pages(model: Transformer, params, prompt_PxQ, mask_PxQ, geo: Geometry):
    """The pool `pool_AxZxUxE` whose pages 0 .. P x J - 1 hold the prompts' prefill in every
    layer (page p*J + j: prompt p's j-th), the rest zeros. The prompts are prefilled in chunks of
    `geo.prefill_prompts`, about the prompts whose rows fill the slots: the prefill's
    activations follow the slots, not the batch."""
    c = model.config
    pool_AxZxUxE = empty_pool(c, geo.pool_pages, geo.page_size)
    if not geo.prompt_pages:
        return pool_AxZxUxE
    (p, q), chunk = prompt_PxQ.shape, geo.prefill_prompts
    chunks = lambda x: x.reshape(p // chunk, chunk, *x.shape[1:])
    prompt_JxCxQ, mask_JxCxQ = chunks(prompt_PxQ), chunks(mask_PxQ)
    layers = c.num_layers

    def fill(j, pool_AxZxUxE):
        prompt_CxQ, mask_CxQ = prompt_JxCxQ[j], mask_JxCxQ[j]
        caches = decoding.prefill(model, params, prompt_CxQ[:, :-1], mask_CxQ[:, :-1], q - 1)
        pad_C = q - mask_CxQ.sum(-1, dtype=jnp.int32)
        as_pages = lambda cache: _as_pages(cache, pad_C, geo, c.transposed_keys)
        stack = jax.vmap(as_pages) if c.scan_layers else lambda xs: jnp.stack([as_pages(x) for x in xs])
        kv_LxAxZxUxE = stack(caches)
        pool_LxMxZxUxE = pool_AxZxUxE.reshape(layers, geo.pool_pages, *pool_AxZxUxE.shape[1:])
        pool_LxMxZxUxE = jax.lax.dynamic_update_slice_in_dim(
            pool_LxMxZxUxE, kv_LxAxZxUxE.astype(c.compute_dtype), j * chunk * geo.prompt_pages, axis=1
        )
        return _heads_split(pool_LxMxZxUxE.reshape(pool_AxZxUxE.shape))

    return jax.lax.fori_loop(0, p // chunk, fill, pool_AxZxUxE)


def copy_pages(pool_AxZxUxE, src_S, dst_S, pages: int):
    """The pool with page `src_S[s]` copied to page `dst_S[s]` in every layer (A = L x M, M =
    `pages`; dst M: no copy), slot by slot: windows of one slot's U x E, as `write_pages` writes
    (on TPU a page-wide window wants another layout of the pool: a copy of it in and out)."""
    a, z = pool_AxZxUxE.shape[:2]
    shape = (a // pages, len(src_S), z)  # every layer's slots of every copied page
    first_LxSxZ = jnp.broadcast_to(jnp.arange(a // pages)[:, None, None] * pages, shape)
    slot_X = jnp.broadcast_to(jnp.arange(z), shape).ravel()
    src_X = (first_LxSxZ + src_S[:, None]).ravel()
    dst_X = jnp.where(dst_S[:, None] < pages, first_LxSxZ + dst_S[:, None], a).ravel()
    return pool_AxZxUxE.at[dst_X, slot_X].set(pool_AxZxUxE[src_X, slot_X], mode="drop")


class Prompts(NamedTuple):
    """Per-prompt facts the loop reads."""

    keys_P: jax.Array  # q_p - 1: keys of the prefill
    last_P: jax.Array  # the prompt's last token, fed at t = 0
    shared_P: jax.Array  # its full pages, shared by its rows: (q_p - 1) // Z
    partial_P: jax.Array  # whether a partial page follows them (copied into each row's own)


class EngineState(NamedTuple):
    row_S: jax.Array  # the row each slot serves; B: none
    step_S: jax.Array  # t: tokens that row has sampled
    feed_S: jax.Array  # the token it feeds next
    order_S: jax.Array  # when the row started (the last started is preempted first)
    table_SxI: jax.Array  # the slot's page table
    pool: jax.Array  # pool_AxZxUxE: every layer's M pages
    free_M: jax.Array  # a stack of free page ids, its top at free_top - 1
    free_top: jax.Array
    waiting_B: jax.Array  # rows not started (or preempted)
    started: jax.Array  # rows started so far (the next order)
    tokens_BxN: jax.Array
    logp_BxN: jax.Array
    ended_B: jax.Array
    length_B: jax.Array
    steps: jax.Array  # decode steps taken
    preemptions: jax.Array
    waits: jax.Array  # slot-steps a running row waited for a page


def _take_pages(st: EngineState, need_S, column_S, geo: Geometry):
    """`(state, granted_S)`: the slots that need a page get one from the free list, in slot
    order while pages last, entered in their tables at `column_S`."""
    rank_S = jnp.cumsum(need_S)
    granted_S = need_S & (rank_S <= st.free_top)
    page_S = st.free_M[jnp.clip(st.free_top - rank_S, 0, geo.pool_pages - 1)]
    at_S = jnp.where(granted_S, jnp.arange(geo.slots), geo.slots)
    table_SxI = st.table_SxI.at[at_S, column_S].set(page_S, mode="drop")
    return st._replace(table_SxI=table_SxI, free_top=st.free_top - granted_S.sum()), granted_S


def _give_back(st: EngineState, release_S, own_from_S, held_S, geo: Geometry) -> EngineState:
    """Releasing slots' own pages (table columns own_from_S .. held_S - 1) pushed on the free list."""
    i_I = jnp.arange(geo.table_pages)
    mask_A = (release_S[:, None] & (i_I >= own_from_S[:, None]) & (i_I < held_S[:, None])).ravel()
    at_A = jnp.where(mask_A, st.free_top + jnp.cumsum(mask_A) - 1, geo.pool_pages)
    free_M = st.free_M.at[at_A].set(st.table_SxI.ravel(), mode="drop")
    return st._replace(free_M=free_M, free_top=st.free_top + mask_A.sum())


def _start_rows(st: EngineState, prompts: Prompts, group: int, geo: Geometry, starts: int) -> EngineState:
    """At most `starts` free slots take the waiting rows in order while one free page is left per
    running row (a row whose prompt ends in a partial page takes one for its copy); a starting
    row's table names its prompt's shared pages. The partial pages are copied `starts` at a
    time: a copy for every slot read and wrote S pages in every layer each step."""
    b = geo.rows
    free_S = st.row_S >= b
    k_S = jnp.cumsum(free_S) - 1
    row_S = jnp.searchsorted(jnp.cumsum(st.waiting_B), k_S + 1, side="left").astype(jnp.int32)
    p_S = jnp.minimum(row_S, b - 1) // group
    cost_S = jnp.where(free_S & (row_S < b), prompts.partial_P[p_S], 0)
    running = geo.slots - free_S.sum()
    start_S = free_S & (row_S < b) & (jnp.cumsum(cost_S) + running + k_S + 1 <= st.free_top) & (k_S < starts)
    i_I = jnp.arange(geo.table_pages)
    prompt_SxI = p_S[:, None] * geo.prompt_pages + i_I
    table_SxI = jnp.where(start_S[:, None] & (i_I < prompts.shared_P[p_S][:, None]), prompt_SxI, st.table_SxI)
    st = st._replace(table_SxI=table_SxI)
    copy_S = start_S & prompts.partial_P[p_S]
    st, _ = _take_pages(st, copy_S, prompts.shared_P[p_S], geo)
    # copy x: the x-th copying slot's (slot S and page M: no copy); unconditional, as a lax.cond
    # here copied the whole pool in and out of its branches every step (docs/tpu_32b_plan.md)
    slot_X = jnp.searchsorted(jnp.cumsum(copy_S), jnp.arange(starts) + 1, side="left")
    at_X = jnp.minimum(slot_X, geo.slots - 1)
    src_X = p_S[at_X] * geo.prompt_pages + prompts.shared_P[p_S[at_X]]
    dst_X = jnp.where(slot_X < geo.slots, st.table_SxI[at_X, prompts.shared_P[p_S[at_X]]], geo.pool_pages)
    pool = copy_pages(st.pool, src_X, dst_X, geo.pool_pages)
    return st._replace(
        row_S=jnp.where(start_S, row_S, st.row_S),
        step_S=jnp.where(start_S, 0, st.step_S),
        feed_S=jnp.where(start_S, prompts.last_P[p_S], st.feed_S),
        order_S=jnp.where(start_S, st.started + k_S, st.order_S),
        pool=pool,
        waiting_B=st.waiting_B.at[jnp.where(start_S, row_S, b)].set(False, mode="drop"),
        started=st.started + start_S.sum(),
    )


def _decode(model, params, config, geo: Geometry, prompts: Prompts, group: int, u_BxN, st: EngineState):
    """`(state, run_S, done_S, keys_S)`: one decode step of the slots whose rows hold (or got) a
    page for their next key (run_S); their tokens, log-probs and ends (done_S) recorded. keys_S:
    the keys each slot's row holds after it."""
    b, z, n_new = geo.rows, geo.page_size, config.max_new_tokens
    active_S = st.row_S < b
    row_S = jnp.minimum(st.row_S, b - 1)
    pos_S = prompts.keys_P[row_S // group] + st.step_S  # this step's key and position
    need_S = active_S & (pos_S % z == 0)
    st, granted_S = _take_pages(st, need_S, pos_S // z, geo)
    run_S = active_S & (~need_S | granted_S)
    slots_S = jnp.arange(geo.slots)
    refs = PageRefs(
        table_BxI=st.table_SxI,
        lengths_B=jnp.where(run_S, pos_S + 1, 0),
        write_page_B=jnp.where(run_S, st.table_SxI[slots_S, pos_S // z], geo.pool_pages),
        write_slot_B=pos_S % z,
    )
    positions_S = jnp.where(run_S, pos_S, 0)
    logits_Sx1xV, pool = model.apply(
        {"params": params}, st.feed_S[:, None], positions_S[:, None], None, st.pool, refs
    )
    step_S = jnp.minimum(st.step_S, n_new - 1)
    # whole vocabularies: sampling's reversals of a vocabulary split over tensor are collective
    # permutes, which XLA:CPU's rendezvous waits on from every device (a loop per shard would hang)
    logits_SxV = nn.with_logical_constraint(logits_Sx1xV[:, 0], ("batch", None))
    token_S, logp_S = decoding.sample_token(logits_SxV, u_BxN[row_S, step_S], config)
    ended_S = jnp.isin(token_S, jnp.asarray(config.eos_ids, jnp.int32).reshape(-1))
    done_S = run_S & (ended_S | (st.step_S + 1 == n_new))
    out_S, fin_S = jnp.where(run_S, row_S, b), jnp.where(done_S, row_S, b)  # B: dropped
    st = st._replace(
        step_S=st.step_S + run_S,
        feed_S=jnp.where(run_S, token_S, st.feed_S),
        pool=pool,
        tokens_BxN=st.tokens_BxN.at[out_S, step_S].set(token_S, mode="drop"),
        logp_BxN=st.logp_BxN.at[out_S, step_S].set(logp_S, mode="drop"),
        ended_B=st.ended_B.at[fin_S].set(ended_S, mode="drop"),
        length_B=st.length_B.at[fin_S].set(st.step_S + 1, mode="drop"),
        steps=st.steps + 1,
        waits=st.waits + (active_S & ~run_S).sum(),
    )
    return st, run_S, done_S, pos_S + run_S


def starts_per_step(geo: Geometry) -> int:
    """Rows a decode step may start, ceil(S / 8): a row ending while as many have started this
    step waits one step for its slot (its tokens unchanged); the first S start before the loop."""
    return -(-geo.slots // 8)


def step(model, params, config, geo: Geometry, prompts: Prompts, group: int, u_BxN, st: EngineState):
    """Decode; free the slots and own pages of the ended rows and, when every running row waits
    for a page, of the last started row (which waits to start again); start waiting rows."""
    b = geo.rows
    active_S = st.row_S < b
    p_S = jnp.minimum(st.row_S, b - 1) // group
    st, run_S, done_S, keys_S = _decode(model, params, config, geo, prompts, group, u_BxN, st)
    stuck = active_S.any() & ~run_S.any()
    victim_S = stuck & active_S & (st.order_S == jnp.max(jnp.where(active_S, st.order_S, -1)))
    release_S = done_S | victim_S
    held_S = -(-keys_S // geo.page_size)
    st = _give_back(st, release_S, prompts.shared_P[p_S], held_S, geo)
    st = st._replace(
        row_S=jnp.where(release_S, b, st.row_S),
        waiting_B=st.waiting_B.at[jnp.where(victim_S, st.row_S, b)].set(True, mode="drop"),
        preemptions=st.preemptions + stuck,
    )
    return _start_rows(st, prompts, group, geo, starts_per_step(geo))


def initial_state(pool_AxZxUxE, geo: Geometry, n_new: int, pad_id: int) -> EngineState:
    b, s, m = geo.rows, geo.slots, geo.pool_pages
    return EngineState(
        row_S=jnp.full((s,), b, jnp.int32),
        step_S=jnp.zeros((s,), jnp.int32),
        feed_S=jnp.zeros((s,), jnp.int32),
        order_S=jnp.zeros((s,), jnp.int32),
        table_SxI=jnp.zeros((s, geo.table_pages), jnp.int32),
        pool=pool_AxZxUxE,
        free_M=jnp.zeros((m,), jnp.int32),
        free_top=jnp.zeros((), jnp.int32),
        waiting_B=jnp.ones((b,), bool),
        started=jnp.zeros((), jnp.int32),
        tokens_BxN=jnp.full((b, n_new), pad_id, jnp.int32),
        logp_BxN=jnp.zeros((b, n_new), jnp.float32),
        ended_B=jnp.zeros((b,), bool),
        length_B=jnp.zeros((b,), jnp.int32),
        steps=jnp.zeros((), jnp.int32),
        preemptions=jnp.zeros((), jnp.int32),
        waits=jnp.zeros((), jnp.int32),
    )


def paged_rollout(model, config: decoding.SamplingConfig, group: int, params, prompt_PxQ, mask_PxQ, u_BxN):
    """`(outputs, stats)`: the P x G rows decoded by the engine (outputs as `sampler.rollout`'s);
    stats: `steps` (decode steps), `waits` (slot-steps a row waited for a page) and
    `preemptions` (rows that gave their pages back)."""
    p, q = prompt_PxQ.shape
    geo = geometry(config, p, group, q)
    keys_P = mask_PxQ.sum(-1, dtype=jnp.int32) - 1
    prompts = Prompts(
        keys_P=keys_P,
        last_P=prompt_PxQ[:, -1],
        shared_P=keys_P // geo.page_size,
        partial_P=keys_P % geo.page_size != 0,
    )
    pool = prefill_pages(model, params, prompt_PxQ, mask_PxQ, geo)
    st = initial_state(pool, geo, config.max_new_tokens, config.pad_id)
    held = p * geo.prompt_pages  # the prompts' pages; the rest start free
    st = st._replace(
        free_M=jnp.arange(geo.pool_pages, dtype=jnp.int32)[::-1], free_top=jnp.int32(geo.pool_pages - held)
    )
    st = _start_rows(st, prompts, group, geo, geo.slots)
    body = lambda st: step(model, params, config, geo, prompts, group, u_BxN, st)
    st = jax.lax.while_loop(lambda st: jnp.any(st.row_S < geo.rows) | st.waiting_B.any(), body, st)
    outputs = decoding.outputs(st.tokens_BxN, st.logp_BxN, st.ended_B, st.length_B)
    return outputs, {"steps": st.steps, "waits": st.waits, "preemptions": st.preemptions}
