"""The rollout controller against a real embedded server, with a simulated trainer.

The "trainer" here does what the real one does around a step: take a batch, spend a
little time "training", pause the controller and the servers, push weights with the
next version (the same weights from disk: the version tag is what matters here),
resume, and tell the controller the new version.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time

import pytest

from realscale.data.dataset import PromptDataset, PromptSample
from realscale.rollout.controller import RolloutController, RolloutError, RolloutExhausted
from realscale.rollout.staleness import StalenessManager
from realscale.rollout.workflows import CalculatorEnv, EnvStep, MultiTurnWorkflow, SingleTurnWorkflow

PARAMS = {"max_new_tokens": 12, "temperature": 1.0}


def _reward_by_length(prompt: str, completion: str, sample: PromptSample) -> float:
    return float(len(completion) % 2)


def _controller(url, tokenizer, dataset, eta: int, *, batch: int = 2, n: int = 2, reward=_reward_by_length,
                **kw) -> RolloutController:
    wf = SingleTurnWorkflow(tokenizer, n, PARAMS, reward, reward_timeout=5.0)
    return RolloutController([url], dataset, wf, StalenessManager(batch, eta, 16), **kw)


def _weight_update(ctl: RolloutController, model_path: str, version: int) -> None:
    ctl.pause()
    ctl.call(lambda c: c.pause())
    ctl.call(lambda c: c.update_weights_from_disk(model_path, version))
    ctl.call(lambda c: c.resume())
    ctl.set_version(version)
    ctl.resume()


def test_staleness_bound_holds(server, tokenizer, arith_jsonl) -> None:
    url, srv = server
    eta, batch = 1, 2
    ds = PromptDataset(arith_jsonl, shuffle=False)  # endless epochs
    with _controller(url, tokenizer, ds, eta, batch=batch) as ctl:
        for version in range(6):
            groups = ctl.get_batch(batch, timeout=30)
            for g in groups:
                lag = version - g.min_version
                assert 0 <= lag <= eta, f"group {g.uid} trained at {version} with tokens of {g.min_version}"
                assert g.min_version >= g.submit_version
            stats = ctl.stats()
            assert stats["accepted"] <= (eta + version + 1) * batch
            assert stats["accepted"] + stats["running"] <= (eta + version + 1) * batch
            time.sleep(0.2)  # "training": rollouts for the next steps run meanwhile
            _weight_update(ctl, srv.model_path, version + 1)
        stats = ctl.stats()
    assert stats["consumed"] == 12
    assert sum(stats["staleness_hist"].values()) == 12
    # asynchrony was real: some groups were generated a version before they were trained
    assert stats["staleness_hist"].get(1, 0) > 0, stats


def test_eta_zero_is_synchronous(server, tokenizer, arith_jsonl) -> None:
    url, srv = server
    batch = 2
    ds = PromptDataset(arith_jsonl, shuffle=False)
    with _controller(url, tokenizer, ds, 0, batch=batch) as ctl:
        for version in range(4):
            groups = ctl.get_batch(batch, timeout=30)
            assert [(g.submit_version, g.min_version) for g in groups] == [(version, version)] * batch
            time.sleep(0.2)  # the controller has time to misbehave, if it would
            stats = ctl.stats()
            # nothing was submitted for version + 1 before the trainer moved on
            assert max(stats["submitted_by_version"]) == version
            assert stats["submitted"] - stats["rejected"] == (version + 1) * batch
            assert stats["running"] == 0 and stats["buffer"] == 0
            _weight_update(ctl, srv.model_path, version + 1)


def test_max_ahead_keeps_samples_fresh(server, tokenizer, arith_jsonl) -> None:
    """Generation far faster than "training": without a limit every group would wait η
    versions; with max_ahead = 2B at most 2B groups are ahead and lags stay <= 2."""
    url, srv = server
    eta, batch = 3, 2
    ds = PromptDataset(arith_jsonl, shuffle=False)
    with _controller(url, tokenizer, ds, eta, batch=batch, max_ahead=2 * batch) as ctl:
        for version in range(6):
            ctl.get_batch(batch, timeout=30)
            time.sleep(0.3)  # "training": the server would refill the whole bound meanwhile
            stats = ctl.stats()
            assert stats["buffer"] + stats["running"] <= 2 * batch, stats
            _weight_update(ctl, srv.model_path, version + 1)
        hist = ctl.stats()["staleness_hist"]
    assert max(hist) <= 2 and sum(hist.values()) == 12, hist
    with pytest.raises(ValueError, match="batch size"):
        _controller(url, tokenizer, ds, eta, batch=batch, max_ahead=1)


def test_dynamic_sampling_drops_all_equal_groups(server, tokenizer, arith_jsonl) -> None:
    url, _ = server

    calls = itertools.count()

    def reward(prompt: str, completion: str, sample: PromptSample) -> float:
        # Odd lines always score 1 (all equal: dropped). Even lines alternate 0/1 per call:
        # the tiny random model's answers are nearly deterministic, so a text-based reward
        # would not vary inside a group.
        line = int(sample.uid.rsplit(":", 1)[1])
        return 1.0 if line % 2 else float(next(calls) % 2)

    ds = PromptDataset(arith_jsonl, shuffle=False, num_epochs=1)
    with _controller(url, tokenizer, ds, 1, n=4, reward=reward, filter_all_equal=True) as ctl:
        groups = ctl.get_batch(2, timeout=30)
        stats = ctl.stats()
    for g in groups:
        assert len(set(g.rewards)) > 1
        assert int(g.uid.rsplit(":", 1)[1]) % 2 == 0
    assert stats["rejected_by_reason"].get("all_equal", 0) >= 1
    # generated_tokens counts the dropped groups' model tokens too (every answer has >= 1: EOS)
    trained = sum(sum(t.loss_mask) for g in groups for t in g)
    assert stats["generated_tokens"] >= trained + 4 * stats["rejected_by_reason"]["all_equal"]


def test_state_dict_resume_no_skip_no_repeat(server, tokenizer, arith_jsonl) -> None:
    url, srv = server
    trained: list[str] = []
    ds = PromptDataset(arith_jsonl, seed=3, num_epochs=1)
    with _controller(url, tokenizer, ds, 2, batch=2) as ctl:
        for version in range(2):
            trained += [g.uid for g in ctl.get_batch(2, timeout=30)]
            _weight_update(ctl, srv.model_path, version + 1)
        time.sleep(0.2)  # let more groups finish into the buffer: they must be regenerated
        state = ctl.state_dict()
    assert state["pending_uids"], "the checkpoint should have caught groups in flight or buffered"
    assert state["staleness"]["accepted"] == 4  # only the consumed groups count
    assert not set(state["pending_uids"]) & set(trained)

    ds2 = PromptDataset(arith_jsonl, seed=3, num_epochs=1)
    ctl2 = _controller(url, tokenizer, ds2, 2, batch=2)
    ctl2.load_state_dict(state)
    with ctl2:
        with pytest.raises(RolloutExhausted):
            for version in range(2, 100):
                trained += [g.uid for g in ctl2.get_batch(2, timeout=30)]
                _weight_update(ctl2, srv.model_path, version + 1)
        assert ctl2.stats()["consumed"] == 12
    assert sorted(trained) == sorted(s.uid for s in ds2.samples)  # each exactly once


class _FlakyEnv(CalculatorEnv):
    """A calculator whose first episode for line 3 crashes (a tool backend that fell over)."""

    crashed: set[str] = set()

    def __init__(self, sample: PromptSample) -> None:
        super().__init__(sample)
        self.uid = sample.uid

    def step(self, action: str) -> EnvStep:
        if self.uid.endswith(":3") and self.uid not in _FlakyEnv.crashed:
            _FlakyEnv.crashed.add(self.uid)
            raise ConnectionError("tool backend unavailable")
        return super().step(action)


def test_failed_episode_is_requeued(server, tokenizer, arith_jsonl) -> None:
    url, _ = server
    ds = PromptDataset(arith_jsonl, shuffle=False, num_epochs=1)
    wf = MultiTurnWorkflow(tokenizer, 2, {"max_new_tokens": 6}, _FlakyEnv, max_turns=2)
    uids: list[str] = []
    with RolloutController([url], ds, wf, StalenessManager(4, 3, 16), retry_backoff=0.01) as ctl:
        for _ in range(3):
            uids += [g.uid for g in ctl.get_batch(4, timeout=30)]
        stats = ctl.stats()
    assert sorted(uids) == sorted(s.uid for s in ds.samples)
    assert stats["failures_by_type"] == {"ConnectionError": 1}


class _SlowToolEnv(CalculatorEnv):
    """Line 1's tool call takes 1.5 s: its first turn is generated long before its second."""

    async def step(self, action: str) -> EnvStep:
        if self.uid.endswith(":1"):
            await asyncio.sleep(1.5)
        return super().step(action)

    def __init__(self, sample: PromptSample) -> None:
        super().__init__(sample)
        self.uid = sample.uid


def test_long_episode_is_waited_for_not_dropped(server, tokenizer, arith_jsonl) -> None:
    """A group whose episode spans many trainer steps is trained within η, never dropped.

    The trainer steps every ~0.1 s while line 1's episode takes > 1.5 s, so by the old
    rule (drop a group that finishes too stale) it would be dropped and regenerated over
    and over, and training would lean towards short episodes."""
    url, srv = server
    eta, batch = 1, 2
    ds = PromptDataset(arith_jsonl, shuffle=False, num_epochs=1)
    wf = MultiTurnWorkflow(tokenizer, 2, {"max_new_tokens": 6}, _SlowToolEnv, max_turns=2)
    trained: dict[str, int] = {}
    with RolloutController([url], ds, wf, StalenessManager(batch, eta, 16)) as ctl:
        for version in range(6):
            for g in ctl.get_batch(batch, timeout=30):
                assert version - g.min_version <= eta, (g.uid, version, g.min_version)
                trained[g.uid] = version
            time.sleep(0.05)
            _weight_update(ctl, srv.model_path, version + 1)
        stats = ctl.stats()
    assert sorted(trained) == sorted(s.uid for s in ds.samples)  # all 12, line 1 included
    assert stats["rejected_by_reason"].get("stale", 0) == 0, stats
    assert stats["due_waits"] >= 1, stats  # the trainer waited for line 1 rather than drop it
    assert trained[ds.samples[0].uid] <= eta  # submitted at version 0: trained by version η


def test_dead_servers_surface_as_error(tokenizer, arith_jsonl) -> None:
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ds = PromptDataset(arith_jsonl, shuffle=False)
    ctl = _controller(f"http://127.0.0.1:{port}", tokenizer, ds, 1, max_consecutive_failures=3,
                      retry_backoff=0.01, client_kwargs={"max_retries": 1, "backoff": 0.01, "connect_timeout": 1.0})
    with ctl:
        t0 = time.monotonic()
        with pytest.raises(RolloutError, match="unreachable"):
            ctl.get_batch(2, timeout=30)
        assert time.monotonic() - t0 < 20
        assert ctl.stats()["failures"] >= 3


def test_no_server_in_rotation_is_an_outage_the_trainer_ends(server, tokenizer, arith_jsonl) -> None:
    """With ``outages_handled`` (the trainer's rollouts) failures while no server is in
    rotation do not end the rollouts: trainer rank 0 republishes the weights to a restarted
    server, which is admitted, and generation goes on (realscale/publish/outage.py)."""
    url, _ = server
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ds = PromptDataset(arith_jsonl, shuffle=False)
    ctl = _controller(f"http://127.0.0.1:{port}", tokenizer, ds, 1, max_consecutive_failures=2,
                      retry_backoff=0.01, client_kwargs={"max_retries": 1, "backoff": 0.01, "connect_timeout": 1.0})
    ctl.outages_handled = True
    with ctl:
        with pytest.raises(TimeoutError):
            ctl.get_batch(2, timeout=3)
        assert ctl.stats()["failures"] >= 2 and ctl.rotation() == []
        ctl.admit_servers([url])  # the restarted server, holding the current weights
        assert ctl.rotation() == [url]
        assert len(ctl.get_batch(2, timeout=60)) == 2


def test_api_misuse_is_clear(tokenizer, arith_jsonl) -> None:
    ds = PromptDataset(arith_jsonl, shuffle=False)
    ctl = _controller("http://127.0.0.1:1", tokenizer, ds, 1)
    with pytest.raises(RuntimeError, match="start"):
        ctl.get_batch(1)
    ctl.set_version(2)
    with pytest.raises(ValueError, match="went back"):
        ctl.set_version(1)


def test_from_config(tokenizer, arith_jsonl) -> None:
    from realscale.config import Config
    from realscale.rollout.workflows import workflow_from_config

    cfg = Config()
    cfg.rollout.batch_size, cfg.rollout.max_staleness, cfg.rollout.workflow = 3, 0, "multi_turn"
    wf = workflow_from_config(cfg, tokenizer)
    assert isinstance(wf, MultiTurnWorkflow) and wf.max_turns == cfg.rollout.max_turns
    assert wf.sampling_params["max_new_tokens"] == cfg.generate.max_new_tokens
    ds = PromptDataset(arith_jsonl, shuffle=False)
    ctl = RolloutController.from_config(cfg, ["http://127.0.0.1:1"], ds, wf)
    assert (ctl.staleness.batch_size, ctl.staleness.max_staleness) == (3, 0)
    cfg.rollout.workflow = "single_turn"
    assert isinstance(workflow_from_config(cfg, tokenizer), SingleTurnWorkflow)


def test_a_group_that_cannot_be_judged_fails_the_batch_at_once(server, tokenizer, arith_jsonl, monkeypatch) -> None:
    """An error after the episode (here the all-equal filter raising, as a concurrent
    import once made it) used to end the episode's task silently: its group never
    finished, and every batch due with it waited for the batch limit (160 s in the run
    that found it) before a timeout that named nothing. Now get_batch raises at once,
    naming the group and the error."""
    url, _ = server

    def broken(*args, **kwargs):
        raise ImportError("cannot import name 'FilterResult' from partially initialized module")

    monkeypatch.setattr("realscale.algo.filtering.dynamic_sampling_filter", broken)
    ds = PromptDataset(arith_jsonl, shuffle=False)
    with _controller(url, tokenizer, ds, 1, filter_all_equal=True) as ctl:
        t0 = time.monotonic()
        with pytest.raises(RolloutError, match="could not be judged: ImportError: cannot import name 'FilterResult'"):
            ctl.get_batch(2, timeout=60)
        assert time.monotonic() - t0 < 20
