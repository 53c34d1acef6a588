"""The rollout side over several processes (realscale/rollout/sharded.py): the split of the
staleness rule, of the servers and of a batch, and the join of the shards' batches."""

from __future__ import annotations

import pytest
import torch

from realscale.config import load_config
from realscale.data.groups import Group, Trajectory
from realscale.rollout.process import RolloutBatch, pack_groups
from realscale.rollout.sharded import (ShardedRollouts, join_batches, join_controller_stats, shard_config,
                                       shard_servers, split_evenly)


def _groups(n: int, lengths: tuple[int, ...] = (3, 5, 2, 4)) -> list[Group]:
    out = []
    for g in range(n):
        trajs = [Trajectory(prompt_ids=[1, 2], output_ids=[g + 3] * k, output_logprobs=[-0.5] * k,
                            output_versions=[g % 2] * k, loss_mask=[1] * k, reward=float((g + j) % 2),
                            group_id=str(g)) for j, k in enumerate(lengths)]
        out.append(Group(trajs, uid=str(g), submit_version=g % 2))
    return out


def test_the_rule_splits_exactly() -> None:
    assert split_evenly(512, 3) == [171, 171, 170] and sum(split_evenly(7, 4)) == 7
    cfg = load_config(None, ["rollout.batch_size=512", "rollout.max_concurrent=2048"])
    shards = [shard_config(cfg, 3, i).rollout for i in range(3)]
    assert sum(r.batch_size for r in shards) == 512 and sum(r.max_concurrent for r in shards) == 2048
    assert {r.max_staleness for r in shards} == {cfg.rollout.max_staleness}
    with pytest.raises(ValueError, match="batch_size"):
        shard_config(load_config(None, ["rollout.batch_size=2"]), 3, 2)


def test_servers_are_dealt_round_robin() -> None:
    urls = [f"http://h:{p}" for p in range(7)]
    assert shard_servers(urls, 3) == [urls[0::3], urls[1::3], urls[2::3]]
    with pytest.raises(ValueError, match="at least 3 servers"):
        shard_servers(urls[:2], 3)


def test_joined_shards_equal_one_packed_batch() -> None:
    cfg = load_config(None, [])
    groups = _groups(5)
    whole = pack_groups(groups, cfg.algo, version=1)
    joined = join_batches([pack_groups(groups[:2], cfg.algo, 1), pack_groups(groups[2:], cfg.algo, 1)])
    assert torch.equal(joined.batch.input_ids, whole.batch.input_ids)
    assert torch.equal(joined.batch.cu_seqlens, whole.batch.cu_seqlens)
    for key, value in whole.batch.fields.items():
        assert torch.equal(joined.batch.fields[key], value), key
    assert joined.uids == whole.uids
    for key, value in whole.stats.items():
        assert joined.stats[key] == pytest.approx(value), key


class _FakeShard:
    def __init__(self, i: int, late: int = 0) -> None:
        self.i, self.calls, self.late = i, [], late

    def next_batch(self, n: int, version: int, timeout: float | None = None, poll_s: float | None = None,
                   waited_s: float = 0.0) -> RolloutBatch | None:
        self.calls.append(("next_batch", n))
        if self.late:
            self.late -= 1
            if poll_s is not None:
                return None  # no share within the slice
            raise TimeoutError("not yet")
        return pack_groups(_groups(n), load_config(None, []).algo, version)

    def rotation(self) -> list[list[str]]:
        return [[f"http://s{self.i}"]]

    def __getattr__(self, op: str):  # noqa: ANN204 - every other operation is recorded
        return lambda *args: self.calls.append((op, *args)) or {"accepted": self.i + 1, "inflight_server_max": self.i}


def test_sharded_rollouts_route_by_owner() -> None:
    shards = [_FakeShard(0), _FakeShard(1)]
    r = ShardedRollouts(shards, [["http://a"], ["http://b/"]], batch_size=5)
    assert r.next_batch(5, 0).batch.num_seqs == 5 * 4
    assert [c for s in shards for c in s.calls if c[0] == "next_batch"] == [("next_batch", 3), ("next_batch", 2)]
    with pytest.raises(ValueError, match="a batch is 5 groups"):
        r.next_batch(4, 0)
    r.retire(["http://b"])
    assert ("retire", ["http://b"]) in shards[1].calls and not any(c[0] == "retire" for c in shards[0].calls)
    with pytest.raises(ValueError, match="not a server of any shard"):
        r.retire(["http://z"])
    r.admit(["http://c"])  # a new server: to the shard with the fewest not retired (b was)
    assert r.servers[1] == ["http://b", "http://c"] and ("admit", ["http://c"]) in shards[1].calls
    r.admit(["http://d"])  # the first of equals
    assert r.servers[0] == ["http://a", "http://d"] and ("admit", ["http://d"]) in shards[0].calls
    r.set_version(3)
    assert all(("set_version", 3) in s.calls for s in shards)
    assert join_controller_stats([{"accepted": 1, "inflight_server_max": 4}, {"accepted": 2}])["accepted"] == 3


def test_a_late_shard_keeps_the_others_shares() -> None:
    shards = [_FakeShard(0), _FakeShard(1, late=1)]
    r = ShardedRollouts(shards, [["http://a"], ["http://b"]], batch_size=4)
    with pytest.raises(TimeoutError):
        r.next_batch(4, 0)
    assert r.next_batch(4, 0).batch.num_seqs == 4 * 4  # shard 0's share from the first call, not asked again
    assert [c[0] for c in shards[0].calls] == ["next_batch"] and [c[0] for c in shards[1].calls] == ["next_batch"] * 2


def test_a_slice_without_every_share_is_none_and_keeps_the_shares() -> None:
    shards = [_FakeShard(0), _FakeShard(1, late=2)]
    r = ShardedRollouts(shards, [["http://a"], ["http://b"]], batch_size=4)
    assert r.next_batch(4, 0, poll_s=1.0) is None and r.next_batch(4, 0, poll_s=1.0) is None
    assert r.next_batch(4, 0, poll_s=1.0).batch.num_seqs == 4 * 4
    assert [c[0] for c in shards[0].calls] == ["next_batch"] and [c[0] for c in shards[1].calls] == ["next_batch"] * 3
    assert r.rotation() == [["http://s0"], ["http://s1"]]


def test_a_restarted_server_joins_the_shard_whose_servers_died() -> None:
    shards = [_FakeShard(0), _FakeShard(1)]
    r = ShardedRollouts(shards, [["http://a"], ["http://b"]], batch_size=2)
    r.retire(["http://b"])  # shard 1 has no server left
    r.admit(["http://c"])
    assert r.servers == [["http://a"], ["http://b", "http://c"]] and ("admit", ["http://c"]) in shards[1].calls
    r.retire(["http://a", "http://b"])  # cumulative, as server control sends it
    r.admit(["http://d", "http://e"])  # shard 0 (none left) first, then the first of equals
    assert r.servers == [["http://a", "http://d", "http://e"], ["http://b", "http://c"]]
