"""Resharding: plans (pure Python, many layout pairs) and their execution on 8 gloo ranks.

Ground truth is slicing the full tensors directly (``pack_shard``); the byte lower bound
is recomputed per GPU by ``lower_bound_elems`` and, independently, by element sets here.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from reshard_cases import lay, small_moe_spec, small_spec, worker

from realscale.parallel.mesh import Layout, LayoutError, Mesh, Strategy
from realscale.parallel.reshard import lower_bound_elems, plan_reshard, shard_index

# (tied embeddings, source, destination, gpus per node, bucket bytes): tp 1/2/4, pp 1/2/4,
# dp 1/2/4/8, identical / overlapping / disjoint meshes, uneven partitions, 2 nodes of 4.
CASES_8 = [
    (False, lay("d1t1p1", 0), lay("d1t4p2", 0), 4, 1 << 12),
    (False, lay("d2t2p2", 0), lay("d8t1p1", 0), 4, 1 << 12),
    (False, lay("d1t4p2", 0), lay("d2t2p2", 0), 4, 1 << 10),
    (False, lay("d1t2p4", 0), lay("d4t2p1", 0), 4, 1 << 16),
    (False, lay("d2t1p4", 0), lay("d1t4p1", 4), 4, 1 << 12),
    (False, lay("d1t4p1", 0), lay("d2t2p1", 4), 4, 1 << 12),
    (False, lay("d2t2p1", 0), lay("d1t1p4", 4), 4, 1 << 12),
    (False, lay("d1t2p2", 0), lay("d1t2p2", 0), 4, 1 << 12),
    (False, lay("d1t2p2", 0, (3, 1)), lay("d1t2p2", 0, (1, 3)), 4, 1 << 12),
    (False, lay("d4t1p1", 0), lay("d1t4p1", 0), 4, 1 << 12),
    (False, lay("d1t4p1", 0), lay("d4t1p1", 4), 4, 1 << 12),
    (False, lay("d2t4p1", 0), lay("d2t1p4", 0), 4, 1 << 12),
    (False, lay("d1t1p4", 0, (1, 1, 1, 1)), lay("d2t2p2", 0), 4, 1 << 12),
    (False, lay("d1t2p1", 2), lay("d1t4p2", 0), 4, 1 << 12),
    (False, lay("d2t2p2", 0), lay("d1t2p1", 6), 4, 1 << 12),
    (False, lay("d1t1p2", 0), lay("d1t1p2", 6), 4, 1 << 12),
    (False, lay("d2t1p2", 4), lay("d2t2p1", 0), 4, 1 << 8),
    (False, lay("d8t1p1", 0), lay("d1t2p4", 0), 4, 1 << 12),
    (True, lay("d1t2p2", 0, (3, 1)), lay("d2t1p2", 4), 4, 1 << 12),
    (True, lay("d1t1p1", 3), lay("d1t2p4", 0), 4, 1 << 12),
    (True, lay("d2t2p2", 0), lay("d4t2p1", 0), 2, 1 << 12),
    (True, lay("d1t4p2", 0), lay("d1t1p1", 7), 2, 1 << 12),
]


# Expert parallelism: a trainer whose ranks hold 1, 2 or 4 of the 4 experts, into servers
# that hold all of them (and back, and between ep degrees)
CASES_MOE = [
    ("moe", lay("d4t2p1e4", 0), lay("d1t2p1", 0), 4, 1 << 12),
    ("moe", lay("d4t2p1e2", 0), lay("d2t2p1", 4), 4, 1 << 12),
    ("moe", lay("d2t2p2e2", 0), lay("d8t1p1e4", 0), 2, 1 << 12),
    ("moe", lay("d8t1p1e4", 0), lay("d4t1p2e2", 0), 4, 1 << 12),
]


@pytest.mark.multiproc
@pytest.mark.parametrize("cases", [CASES_8, CASES_MOE], ids=["dense", "experts"])
def test_reshard_8_gloo_ranks_bit_identical_at_lower_bound(cases):
    from realscale.parallel.spawn import run_distributed

    per_rank = run_distributed(worker, 8, cases, timeout=300)
    for ci in range(len(cases)):
        for rank in range(8):
            r = per_rank[rank][ci]
            assert r["identical"], f"rank {rank}: {r['case']} does not match direct slicing"
            assert r["recv"] == r["lower_bound"] == r["plan_recv"], f"rank {rank}: {r}"
            assert r["on_comm_device"], f"rank {rank}: {r['case']}: buffers off the collective's device"
    # The sweep moved data (a plan that sends nothing would pass the equality above only
    # for the identity case).
    assert sum(per_rank[r][1]["recv"] for r in range(8)) > 0


def _strategies(n: int):
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            if n % (tp * pp) == 0:
                yield Strategy(n // (tp * pp), tp, pp)


def _layouts():
    for start, size in ((0, 8), (0, 4), (4, 4), (2, 2), (0, 2), (5, 1)):
        for s in _strategies(size):
            yield Layout(Mesh(start, size), s)


def _element_sets(spec, layout, gpu):
    """The set of (tensor, flat element) pairs ``gpu`` holds: brute force, no row math."""
    idx = shard_index(spec, layout, gpu)
    out = set()
    if idx is None:
        return out
    for ti, (lo, hi, _) in idx.entries.items():
        t = spec.tensors[ti]
        outer, rows, inner = t.view3()
        grid = np.arange(t.numel).reshape(outer, rows, inner)[:, lo:hi, :].ravel()
        out.update((ti, int(e)) for e in grid)
    return out


def test_plan_receives_exactly_the_missing_elements_over_all_layout_pairs():
    spec = small_spec(tied=True)
    layouts = list(_layouts())
    pairs = list(itertools.product(layouts, layouts))
    assert len(pairs) > 300
    for src, dst in pairs:
        plan = plan_reshard(spec, src, dst, gpus_per_node=4)
        lb = lower_bound_elems(spec, src, dst)
        assert {g: plan.recv_elems.get(g, 0) for g in dst.mesh.gpus} == lb, f"{src} -> {dst}"
        # Each sender holds what it sends; each receiver gets each element once.
        got: dict[int, list] = {}
        for tr in plan.transfers:
            sidx = shard_index(spec, src, tr.sender)
            sidx.intervals(spec, tr.pieces)  # raises when the sender lacks a piece
            for r in tr.receivers:
                got.setdefault(r, []).extend(tr.pieces)
        for g, pieces in got.items():
            elems = [p.numel(spec) for p in pieces]
            assert sum(elems) == lb[g]


def test_an_expert_parallel_rank_holds_only_its_experts():
    spec = small_moe_spec()
    layout = lay("d4t2p1e2", 0)  # dp coordinate d holds experts of ep rank d % 2: {0, 1} or {2, 3}
    for gpu in range(8):
        dp, tp, _ = layout.coords_of_gpu(gpu)
        held = {spec.tensors[i].expert for i in shard_index(spec, layout, gpu).entries} - {-1}
        assert held == ({0, 1} if dp % 2 == 0 else {2, 3}), (gpu, held)
    dense = sum(t.numel for t in spec.tensors if t.expert < 0)
    experts = sum(t.numel for t in spec.tensors if t.expert >= 0)
    assert shard_index(spec, lay("d4t1p1e2", 0), 0).numel == dense + experts // 2


def test_expert_layout_pairs_plan_exactly_the_missing_elements():
    spec = small_moe_spec()
    layouts = [lay(t, start) for t, start in (("d4t1p1e4", 0), ("d4t2p1e2", 0), ("d2t2p2e2", 0), ("d8t1p1e4", 0),
                                               ("d2t1p1e2", 4), ("d1t2p1", 0), ("d2t2p1", 2), ("d1t1p1", 5),
                                               ("d4t1p2e4", 0), ("d2t1p2", 4))]
    for src, dst in itertools.product(layouts, layouts):
        plan = plan_reshard(spec, src, dst, gpus_per_node=4)
        lb = lower_bound_elems(spec, src, dst)
        assert {g: plan.recv_elems.get(g, 0) for g in dst.mesh.gpus} == lb, f"{src} -> {dst}"
        for gpu in dst.mesh.gpus:
            assert lb[gpu] == len(_element_sets(spec, dst, gpu) - _element_sets(spec, src, gpu)), (src, dst, gpu)
        for tr in plan.transfers:
            shard_index(spec, src, tr.sender).intervals(spec, tr.pieces)  # raises when the sender lacks a piece


def test_lower_bound_matches_element_sets():
    spec = small_spec(tied=True)
    for src, dst in [(Layout(Mesh(0, 8), Strategy(2, 2, 2)), Layout(Mesh(0, 4), Strategy(1, 4, 1))),
                     (Layout(Mesh(0, 4), Strategy(1, 2, 2), (3, 1)), Layout(Mesh(2, 2), Strategy(1, 1, 2)))]:
        lb = lower_bound_elems(spec, src, dst)
        for gpu in dst.mesh.gpus:
            want = _element_sets(spec, dst, gpu) - _element_sets(spec, src, gpu)
            assert lb[gpu] == len(want)


def test_broadcast_groups_dp_replicas_and_prefers_same_node():
    spec = small_spec()
    # 4 dp replicas on two nodes need the same tp=1 weights: one broadcast per slice.
    plan = plan_reshard(spec, Layout(Mesh(0, 2), Strategy(1, 2, 1)), Layout(Mesh(4, 4), Strategy(4, 1, 1)),
                        gpus_per_node=4)
    assert all(len(tr.receivers) == 4 for tr in plan.transfers)
    # Replicas on both nodes hold the slice: receivers on node 1 get it from node 1.
    plan = plan_reshard(spec, Layout(Mesh(0, 8), Strategy(4, 2, 1)), Layout(Mesh(0, 8), Strategy(2, 4, 1)),
                        gpus_per_node=4)
    assert plan.total_recv_bytes() > 0 and plan.cross_node_bytes() == 0


def test_senders_are_load_balanced():
    spec = small_spec()
    plan = plan_reshard(spec, Layout(Mesh(0, 4), Strategy(4, 1, 1)), Layout(Mesh(4, 4), Strategy(1, 4, 1)),
                        gpus_per_node=8)
    sends = [plan.send_elems.get(g, 0) for g in range(4)]
    total = sum(sends)
    biggest_piece = max(p.numel(spec) for tr in plan.transfers for p in tr.pieces)
    assert max(sends) <= total / 4 + biggest_piece
    assert min(sends) > 0


def test_bad_layouts_are_refused_with_reasons():
    spec = small_spec()
    with pytest.raises(LayoutError, match="key/value head groups"):
        plan_reshard(spec, Layout(Mesh(0, 8), Strategy(1, 8, 1)), Layout(Mesh(0, 1), Strategy()))
    with pytest.raises(LayoutError, match="needs 4 GPUs but the mesh has 2"):
        Layout(Mesh(0, 2), Strategy(2, 2, 1))
    with pytest.raises(LayoutError, match="more than the model's 4 layers"):
        plan_reshard(spec, Layout(Mesh(0, 8), Strategy(1, 1, 8)), Layout(Mesh(0, 1), Strategy()))
    with pytest.raises(LayoutError, match="covers 5 layers"):
        plan_reshard(spec, Layout(Mesh(0, 2), Strategy(1, 1, 2), (3, 2)), Layout(Mesh(0, 1), Strategy()))
    with pytest.raises(LayoutError, match="empty stage"):
        Layout(Mesh(0, 2), Strategy(1, 1, 2), (4, 0))
    with pytest.raises(LayoutError, match="expected e.g."):
        Strategy.parse("d2x4")
    with pytest.raises(LayoutError, match="ep=2 must divide dp=3"):
        Strategy.parse("d3e2")
    with pytest.raises(LayoutError, match="ep=2 does not divide a dense model"):
        plan_reshard(spec, lay("d2e2", 0), lay("d1", 0))
    with pytest.raises(LayoutError, match="ep=8 does not divide the 4 experts"):
        plan_reshard(small_moe_spec(), lay("d8e8", 0), lay("d1", 0))
    assert str(Strategy.parse("e2d4t2")) == "d4t2p1e2" and str(Strategy.parse("d4t2")) == "d4t2p1"
