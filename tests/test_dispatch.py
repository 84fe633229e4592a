"""Dispatch modes against a plain per-expert reference loop, and capacity drop counts."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moelab.config import MoEConfig
from moelab.model.dispatch import DISPATCHES, Experts
from moelab.model.router import Routing, route


def reference_moe(x, routing, experts):
    """Loop over tokens and their k choices in numpy: the definition of the MoE output."""
    x, idx, w = np.asarray(x), np.asarray(routing.experts), np.asarray(routing.weights)
    wg, wu, wd = (np.asarray(a, np.float64) for a in (experts.w_gate, experts.w_up, experts.w_down))
    out = np.zeros(x.shape, np.float64)
    for b, s in np.ndindex(x.shape[:2]):
        for k in range(idx.shape[-1]):
            e = idx[b, s, k]
            gate, up = x[b, s] @ wg[e], x[b, s] @ wu[e]
            out[b, s] += w[b, s, k] * ((gate / (1 + np.exp(-gate)) * up) @ wd[e])
    return out


def random_problem(seed, batch, seq, d, f, n_experts, top_k, router="softmax"):
    """Inputs, routing and experts made under jit (eager ops compile once per shape: slow)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(batch, seq, d)), jnp.float32)
    logits = jnp.asarray(rng.normal(size=(batch, seq, n_experts)) * 2, jnp.float32)
    moe = MoEConfig(n_experts=n_experts, top_k=top_k, router=router)
    routing, _ = jax.jit(route, static_argnums=1)(logits, moe)
    make = jax.jit(lambda key: Experts.init(n_experts, d, f, 0.3, key))
    return x, routing, make(jax.random.key(seed)), moe


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(1, 3),
    seq=st.integers(1, 24),
    n_experts=st.sampled_from([1, 2, 4, 8]),
    top_k=st.integers(1, 3),
    block=st.sampled_from([1, 4, 16]),
    impl=st.sampled_from(["blocked", "ragged", "slab"]),
    router=st.sampled_from(["softmax", "sigmoid"]),
)
def test_dropless_matches_reference(seed, batch, seq, n_experts, top_k, block, impl, router):
    top_k = min(top_k, n_experts)
    x, routing, experts, moe = random_problem(seed, batch, seq, 8, 12, n_experts, top_k, router)
    moe = MoEConfig(n_experts=n_experts, top_k=top_k, dispatch="dropless",
                    dropless_impl=impl, block_size=block)
    y, dropped = jax.jit(DISPATCHES["dropless"], static_argnums=3)(x, routing, experts, moe)
    assert int(dropped.total) == 0
    np.testing.assert_allclose(np.asarray(y), reference_moe(x, routing, experts), atol=1e-5)


# (batch, seq, block): runs longer than 4 blocks; runs shorter than one block whose
# shifted read starts inside the previous experts' rows (masked); fewer rows than 4 blocks.
# The slab holds ceil(rows / experts) rounded up to 8 rows per expert: at (2, 32) routing
# puts more than 16 rows on some experts (the rest go through its blocked loop) and none
# on others (empty slots); at (4, 64, "skewed") one expert takes most rows.
@pytest.mark.parametrize("batch, seq, block, skew", [(2, 32, 8, 0.0), (1, 12, 8, 0.0),
                                                     (1, 5, 16, 0.0), (4, 64, 8, 4.0)])
@pytest.mark.parametrize("impl", ["blocked", "slab"])
def test_kernels_agree_with_ragged_dot_including_gradients(batch, seq, block, skew, impl):
    x, routing, experts, _ = random_problem(3, batch, seq, 16, 24, 8, 2)
    if skew:
        logits = jnp.asarray(np.random.default_rng(4).normal(size=(batch, seq, 8)))
        routing, _ = route(logits.at[..., 0].add(skew), MoEConfig(n_experts=8, top_k=2))
        assert np.bincount(np.asarray(routing.experts).ravel()).max() > batch * seq / 2

    def loss(experts, x, impl):
        moe = MoEConfig(n_experts=8, top_k=2, dispatch="dropless", dropless_impl=impl,
                        block_size=block)
        y, _ = DISPATCHES["dropless"](x, routing, experts, moe)
        return jnp.sum(jnp.sin(y))

    # The same float32 sums in another order: a weight gradient sums over up to all
    # batch * seq * 2 = 512 rows, each rounding adding <= 2^-24 relative, so the two can
    # lie 512 * 2^-24 = 3e-5 apart relative to the terms' size; 1e-5 absolute for the rest
    (va, ga) = jax.value_and_grad(loss, argnums=(0, 1))(experts, x, "ragged")
    (vb, gb) = jax.value_and_grad(loss, argnums=(0, 1))(experts, x, impl)
    np.testing.assert_allclose(va, vb, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        np.testing.assert_allclose(a, b, rtol=3e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["capacity", "pooled"])
def test_large_capacity_drops_nothing_and_equals_dropless(mode):
    x, routing, experts, _ = random_problem(7, 4, 16, 8, 12, 4, 2)
    big = MoEConfig(n_experts=4, top_k=2, dispatch=mode, capacity_factor=4.0, pool_size=2)
    y, dropped = DISPATCHES[mode](x, routing, experts, big)
    y_ref, _ = DISPATCHES["dropless"](x, routing, experts, MoEConfig(n_experts=4, top_k=2))
    assert int(dropped.total) == 0
    np.testing.assert_allclose(y, y_ref, atol=1e-5)


def skewed_routing(batch, seq, n_experts, hot_share):
    """top-1 routing where the first `hot_share` of each sequence picks expert 0."""
    hot = int(seq * hot_share)
    experts = np.tile(np.arange(seq) % n_experts, (batch, 1))
    experts[:, :hot] = 0
    return Routing(jnp.asarray(experts[..., None]), jnp.ones((batch, seq, 1)))


def expected_drops(experts, n_experts, cap):
    """Hand count: per group, an expert keeps its first `cap` assignments."""
    drops = 0
    for group in experts:
        counts = np.bincount(group.reshape(-1), minlength=n_experts)
        drops += np.maximum(counts - cap, 0).sum()
    return drops


def test_skewed_router_drops_exactly_the_overflow():
    batch, seq, n_experts, cf = 4, 32, 4, 1.0
    routing = skewed_routing(batch, seq, n_experts, hot_share=0.5)
    x = jax.random.normal(jax.random.key(0), (batch, seq, 8))
    experts = Experts.init(n_experts, 8, 8, 0.3, jax.random.key(1))
    moe = MoEConfig(n_experts=n_experts, top_k=1, dispatch="capacity", capacity_factor=cf)
    y, dropped = DISPATCHES["capacity"](x, routing, experts, moe)
    cap = math.ceil(cf * seq * 1 / n_experts)
    idx = np.asarray(routing.experts)
    assert int(dropped.total) == expected_drops(idx, n_experts, cap) == batch * (16 + 4 - cap)
    # A dropped token's expert output is exactly zero; a kept one's is not.
    out = np.asarray(y)
    zero_rows = np.all(out == 0, axis=-1)
    kept_rank = np.array([[np.sum(idx[b, :s, 0] == idx[b, s, 0]) for s in range(seq)]
                          for b in range(batch)])
    np.testing.assert_array_equal(zero_rows, kept_rank >= cap)


def test_pooling_drops_fewer_than_per_sequence_capacity():
    # Sequence b routes mostly to expert b: per-sequence capacity overflows, the pool does not.
    batch, seq, n_experts = 4, 16, 4
    experts = np.tile(np.arange(seq) % n_experts, (batch, 1))
    for b in range(batch):
        experts[b, : seq // 2] = b
    routing = Routing(jnp.asarray(experts[..., None]), jnp.ones((batch, seq, 1)))
    x = jnp.ones((batch, seq, 8))
    ex = Experts.init(n_experts, 8, 8, 0.3, jax.random.key(1))
    per_seq = MoEConfig(n_experts=4, top_k=1, dispatch="capacity", capacity_factor=1.0)
    pooled = MoEConfig(n_experts=4, top_k=1, dispatch="pooled", capacity_factor=1.0)
    _, d_seq = DISPATCHES["capacity"](x, routing, ex, per_seq)
    _, d_pool = DISPATCHES["pooled"](x, routing, ex, pooled)
    assert int(d_seq.total) == expected_drops(experts[..., None], 4, 4) == 24
    assert int(d_pool.total) == expected_drops(experts.reshape(1, -1, 1), 4, 16) == 0


def reference_wave(experts, n_experts, send_cap, keep_cap):
    """The pooled-wave rule as loops: (sent, kept) masks of routing [shards, T, K]."""
    shards, tokens, k = experts.shape
    per_shard = n_experts // shards
    sent = np.zeros(experts.shape, bool)
    queue = [[[] for _ in range(shards)] for _ in range(n_experts)]  # [expert][sender]
    for s in range(shards):
        shipped = [0] * shards
        for choice in range(k):  # first choices first, then earlier tokens
            for t in range(tokens):
                e = experts[s, t, choice]
                if shipped[e // per_shard] < send_cap:
                    shipped[e // per_shard] += 1
                    sent[s, t, choice] = True
                    queue[e][s].append((t, choice))
    kept = np.zeros(experts.shape, bool)
    for e in range(n_experts):
        order = [(e + j) % shards for j in range(shards)]  # round robin from sender e
        filled = 0
        for i in range(tokens * k):
            for s in order:
                if i < len(queue[e][s]) and filled < keep_cap:
                    kept[(s, *queue[e][s][i])] = True
                    filled += 1
    return sent, kept


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), shards=st.sampled_from([1, 2, 4]),
       send_cf=st.sampled_from([0.5, 1.0, 2.0]), cf=st.sampled_from([0.5, 1.0, 1.25]))
def test_pooled_wave_drops_exactly_what_the_rule_says(seed, shards, send_cf, cf):
    from moelab.model.dispatch.pooled_wave import pooled_wave_dispatch, wave_capacities, wave_plan

    x, routing, experts, _ = random_problem(seed, 4, 6, 8, 12, 8, 2)
    moe = MoEConfig(n_experts=8, top_k=2, dispatch="pooled_wave", capacity_factor=cf,
                    send_capacity_factor=send_cf)
    es = routing.experts.reshape(shards, -1, 2)
    send_cap, keep_cap = wave_capacities(es.shape[1], moe, shards)
    plans, _, kept = jax.jit(wave_plan, static_argnums=1)(es, moe)
    want_sent, want_kept = reference_wave(np.asarray(es), 8, send_cap, keep_cap)
    np.testing.assert_array_equal(plans.sent, want_sent)
    np.testing.assert_array_equal(kept, want_kept)
    y, drops = jax.jit(pooled_wave_dispatch, static_argnums=(3, 4))(x, routing, experts, moe,
                                                                     shards)
    masked = Routing(routing.experts, jnp.where(want_kept.reshape(routing.experts.shape),
                                                routing.weights, 0.0))
    np.testing.assert_allclose(np.asarray(y), reference_moe(x, masked, experts), atol=1e-5)
    assert int(drops.sender) == (~want_sent).sum()
    assert int(drops.receiver) == (want_sent & ~want_kept).sum()
    assert int(drops.padding) == shards * shards * send_cap - want_sent.sum()


# Runs of every length around the chunk sizes (block 2, so full chunks of CHUNK_BLOCKS * 2
# rows): empty, shorter than a block, each tail of 1 to CHUNK_BLOCKS blocks, full or
# partial, after zero, one or several full chunks.
RUNS = [0, 1, 2, 3, 5, 8, 9, 15, 16, 17, 31, 33, 47, 2, 0, 64]


def test_every_row_of_every_run_is_owned_by_exactly_one_chunk():
    from moelab.model.dispatch.grouped import CHUNK_BLOCKS, _for_each_chunk, chunk_rows

    block, sizes = 2, jnp.asarray(RUNS, jnp.int32)
    n = sum(RUNS)
    rows = n + chunk_rows(block)

    def body(carry, e, read, lo, hi, size):
        owned, reads, chunks = carry
        r = read + jnp.arange(size)
        mine = jnp.ones(size, bool) if lo is None else (r >= lo) & (r < hi)
        owned = owned.at[r].add(jnp.where(mine, e + 1, 0))  # which expert owns each row
        reads = jnp.minimum(reads[0], read), jnp.maximum(reads[1], read + size)
        return owned, reads, chunks.at[e].add(1)

    init = (jnp.zeros(rows, jnp.int32), (jnp.int32(rows), jnp.int32(0)),
            jnp.zeros(len(RUNS), jnp.int32))
    owned, (lowest, highest), chunks = jax.jit(
        lambda s: _for_each_chunk(s, block, body, init))(sizes)
    expected = np.repeat(np.arange(len(RUNS)) + 1, RUNS)
    np.testing.assert_array_equal(np.asarray(owned)[:n], expected)  # once, by its expert
    assert int(lowest) >= 0 and int(highest) <= rows
    # full chunks, then one chunk per binary digit of the tail in blocks: the matmul count
    big = chunk_rows(block)
    want = [c // big + bin(-(-(c % big) // block)).count("1") for c in RUNS]
    np.testing.assert_array_equal(np.asarray(chunks), want)
    assert CHUNK_BLOCKS & (CHUNK_BLOCKS - 1) == 0  # a power of 2: the digits cover a tail


@pytest.mark.parametrize("kernel", ["grouped_swiglu", "slab_swiglu"])
def test_kernels_agree_with_ragged_dot_on_every_run_length(kernel):
    from moelab.model.dispatch import grouped

    sizes = jnp.asarray(RUNS, jnp.int32)
    n, d, f = sum(RUNS), 8, 12
    keys = jax.random.split(jax.random.key(5), 5)
    rows, ct = (jax.random.normal(k, (n, d)) for k in keys[:2])
    w_gate, w_up = (jax.random.normal(k, (len(RUNS), d, f)) * 0.3 for k in keys[2:4])
    w_down = jax.random.normal(keys[4], (len(RUNS), f, d)) * 0.3

    def ragged(rows, w_gate, w_up, w_down):
        gate = jax.lax.ragged_dot(rows, w_gate, sizes)
        up = jax.lax.ragged_dot(rows, w_up, sizes)
        return jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, sizes)

    def ours(rows, w_gate, w_up, w_down):
        return getattr(grouped, kernel)(rows, sizes, w_gate, w_up, w_down, 2)

    def grads(fn):
        loss = lambda *a: jnp.sum(fn(*a) * ct)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(rows, w_gate, w_up,
                                                                          w_down)

    (va, ga), (vb, gb) = grads(ragged), grads(ours)
    # float32 sums in another order over at most 64 rows (a run) or 12 / 8 terms (a
    # row): 64 * 2^-24 relative is 4e-6, so 1e-5 relative with 1e-5 absolute for terms
    # that cancel
    np.testing.assert_allclose(va, vb, rtol=1e-5)
    for a, b in zip(ga, gb, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- the registry


def dense_dispatch(x, routing, experts, moe):
    """A toy fifth dispatch: every expert runs on every token, each token keeps its top-k
    outputs. The same function as dropless (nothing dropped), computed another way."""
    from moelab.model.dispatch import Drops

    b, s, d = x.shape
    k = routing.experts.shape[-1]
    out = experts(jnp.broadcast_to(x.reshape(1, b * s, d), (moe.n_experts, b * s, d)))
    es, ws = routing.experts.reshape(-1, k), routing.weights.reshape(-1, k)
    picked = out[es, jnp.arange(b * s)[:, None]]  # [T, K, D]: out[e_tk, t]
    y = jnp.einsum("tk,tkd->td", ws.astype(x.dtype), picked)
    return y.reshape(b, s, d), Drops.at_expert(0)


def check_dense(cfg):
    from moelab.config import ConfigError

    if cfg.mesh.expert > 1:
        raise ConfigError("mesh.expert: the dense toy dispatch runs on one device; set 1")


@pytest.fixture
def dense(monkeypatch):
    """The toy registered for this test only (the registry is as it was afterwards)."""
    from moelab.model.dispatch import DispatchEntry

    entry = DispatchEntry("dense", dense_dispatch, drops=False, check=check_dense)
    monkeypatch.setitem(DISPATCHES, "dense", entry)
    return entry


def test_the_config_takes_exactly_the_registered_dispatch_names(dense):
    """moe.dispatch is checked by the registry, not by a list in the config: the toy,
    registered in this file alone, loads; a name nobody registered is refused naming the
    field and the registered names."""
    from moelab.config import ConfigError, config_from_dict
    from moelab.parallel import expert  # noqa: F401  (fills the expert-parallel forms)

    assert config_from_dict({"moe": {"dispatch": "dense"}}).moe.dispatch == "dense"
    with pytest.raises(ConfigError, match=r"moe\.dispatch: 'magic' is not one of .*'dense'"):
        config_from_dict({"moe": {"dispatch": "magic"}})
    builtins = {n: e for n, e in DISPATCHES.items() if n != "dense"}
    assert set(builtins) == {"capacity", "pooled", "pooled_wave", "dropless"}
    assert all(entry.expert_parallel is not None for entry in builtins.values())
    assert [n for n, e in builtins.items() if not e.drops] == ["dropless"]


def test_a_dispatch_registered_in_one_place_trains_and_is_checked(dense):
    """The toy, registered above and nowhere else, is built into an MoE layer by name and
    gives dropless's output and gradients (the same function: only the summation order
    differs, ~1e-7 relative per f32 op, so 1e-5 absolute on O(1) values leaves room), and its
    mesh check runs where every dispatch's does."""
    import dataclasses

    import equinox as eqx

    from moelab.config import ConfigError, config_from_dict
    from moelab.model.dispatch import check_dispatch
    from moelab.model.moe import MoE

    base = config_from_dict({"model": {"d_model": 16, "d_ff": 24},
                             "moe": {"n_experts": 4, "top_k": 2}})
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 16)), jnp.float32)
    loss = eqx.filter_jit(eqx.filter_value_and_grad(lambda layer: jnp.sum(layer(x)[0] ** 2)))
    results = {}
    for name in ("dropless", "dense"):
        layer = MoE.init(base.model, dataclasses.replace(base.moe, dispatch=name),
                         jax.random.key(0))
        assert layer.dispatch is DISPATCHES[name].local
        results[name] = loss(layer)
    (value, grads), (ref_value, ref_grads) = results["dense"], results["dropless"]
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, ref, atol=1e-5)

    one = dataclasses.replace(base, moe=dataclasses.replace(base.moe, dispatch="dense"))
    check_dispatch(one)
    two = dataclasses.replace(one, mesh=dataclasses.replace(one.mesh, expert=2))
    with pytest.raises(ConfigError, match=r"mesh\.expert"):
        check_dispatch(two)
