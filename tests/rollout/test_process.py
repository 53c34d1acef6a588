"""The rollout controller in its own process, against a real embedded server: batches
come back packed (the child packs numpy arrays and never imports torch; rank 0 makes the
tensors, equal to the in-process packing), rank 0's server control pauses and updates the
servers with its own client, errors keep their type, a dead child is an error, and retired
servers and paused request clocks reach the controller's client."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from realscale.config import load_config
from realscale.publish.control import ServerControl, ServerEndpoint
from realscale.rollout.controller import RolloutError, client_factory
from realscale.rollout.process import ControllerProcess, LocalRollouts, start_rollouts


def _torch_loaded(pid: int) -> list[str]:
    """torch's shared libraries mapped into process ``pid`` (any ``import torch`` loads
    them: ``torch/__init__.py`` imports ``torch._C``)."""
    with open(f"/proc/{pid}/maps") as fh:
        return sorted({line.split()[-1] for line in fh if "libtorch" in line or "/torch/_C" in line})


def _cfg(arith_jsonl: str, *extra: str):
    return load_config(None, ["rollout.batch_size=2", "rollout.n_samples=2", "rollout.max_staleness=1",
                              "rollout.max_concurrent=4", f"data.source={arith_jsonl}", "generate.max_new_tokens=8",
                              *extra])


def test_controller_process_trains_three_versions(server, arith_jsonl, tmp_path) -> None:
    url, srv = server
    cfg = _cfg(arith_jsonl)
    rollouts = start_rollouts(cfg, srv.model_path, [url], str(tmp_path))
    assert isinstance(rollouts, ControllerProcess)
    control = ServerControl(rollouts, [ServerEndpoint(url)], client_factory(cfg, [url]))
    try:
        rollouts.resume()
        for version in range(3):
            rb = rollouts.next_batch(2, version, timeout=300)
            b = rb.batch
            assert b.num_seqs == 4 and len(rb.uids) == 2
            assert b.input_ids.dtype == torch.long and b.cu_seqlens[-1] == b.num_tokens
            assert set(b.fields) == {"loss_mask", "behav_logprobs", "advantages", "versions"}
            assert 0 <= rb.stats["staleness/max"] <= 1
            assert rb.stats["perf/trained_tokens"] == float(b.fields["loss_mask"].sum()) > 0
            control.pause(cfg.generate.pause_mode)
            control.run(lambda c, v=version: c.update_weights_from_disk(srv.model_path, v + 1))
            control.resume(version + 1)
        stats = rollouts.stats()
        assert stats["consumed"] == 6 and stats["version"] == 3
        assert rollouts.state_dict()["consumed"] == 6
        with pytest.raises(TimeoutError, match="get_batch"):  # the child's error, its type kept
            rollouts.next_batch(50, 3, timeout=0.5)
        # served three batches without torch: it packs numpy, rank 0 makes the tensors (and its
        # tokenizer loads without transformers, whose AutoTokenizer would import torch)
        assert _torch_loaded(rollouts._proc.pid) == []
    finally:
        control.close()
        rollouts.stop()
    assert rollouts._proc.exitcode == 0


@pytest.mark.parametrize("algo", [["algo.adv_estimator=grpo"], ["algo.adv_estimator=gae", "algo.routing_replay=true"]])
def test_a_batch_over_the_pipe_equals_the_one_packed_in_process(algo: list[str]) -> None:
    """What the child sends (arrays behind a header) is, once rank 0 converts it, the batch
    that packing in one process gives: every tensor, dtype and statistic."""
    import multiprocessing as mp
    import threading

    import numpy as np

    from realscale.data.groups import Group, Trajectory
    from realscale.rollout.process import _recv_batch, _send_batch, pack_groups, pack_groups_raw

    cfg = load_config(None, algo)
    groups = []
    for g in range(3):
        trajs = []
        for j in range(4):
            n_p, n_o = 5 + g, 300 * (j + 1)  # some arrays past a pipe's buffer
            trajs.append(Trajectory(prompt_ids=list(range(n_p)), output_ids=[g + 7] * n_o,
                                    output_logprobs=[-0.1 * (j + 1)] * n_o, output_versions=[g] * n_o,
                                    loss_mask=[1, 0] * (n_o // 2), reward=float((g + j) % 2), group_id=str(g),
                                    routed_experts=np.arange((n_p + n_o - 1) * 4, dtype=np.int32)))
        groups.append(Group(trajs, uid=str(g), submit_version=g))
    here = pack_groups(groups, cfg.algo, version=3)
    parent, child = mp.get_context("spawn").Pipe()
    sender = threading.Thread(target=_send_batch, args=(child, pack_groups_raw(groups, cfg.algo, 3)))
    sender.start()
    kind, header = parent.recv()
    got = _recv_batch(parent, header).packed(cfg.algo)
    sender.join()
    assert kind == "batch" and got.stats == here.stats and got.uids == here.uids
    want = here.batch.to_payload()
    assert list(got.batch.to_payload()) == list(want)
    assert ("f.routed_experts" in want) == cfg.algo.routing_replay and ("f.rewards" in want) == (
        cfg.algo.adv_estimator == "gae")
    for key, value in got.batch.to_payload().items():
        assert value.dtype == want[key].dtype and torch.equal(value, want[key]), key


def test_start_up_error_and_dead_child_are_reported(server, arith_jsonl, tmp_path) -> None:
    url, srv = server
    from realscale.data.dataset import DatasetError

    with pytest.raises(DatasetError, match="dataset file not found"):
        start_rollouts(_cfg("/no/such.jsonl"), srv.model_path, [url], str(tmp_path))
    # started generating at once (a fresh run's driver): its start-up error comes with the first call
    early = start_rollouts(_cfg("/no/such.jsonl"), srv.model_path, [url], str(tmp_path), go=True)
    with pytest.raises(DatasetError, match="dataset file not found"):
        early.stats()
    early.stop()
    rollouts = ControllerProcess(_cfg(arith_jsonl), srv.model_path, [url], str(tmp_path))
    rollouts.ready()
    os.kill(rollouts._proc.pid, signal.SIGKILL)
    with pytest.raises(RolloutError, match="died"):
        rollouts.stats()
    rollouts.stop()


@pytest.mark.parametrize("process", [True, False])
def test_started_with_go_generates_without_a_resume(server, arith_jsonl, tmp_path, process: bool) -> None:
    """A fresh run's driver starts its rollouts generating before it builds its engine
    (Trainer.__init__): the first batch comes without a resume, at version 0."""
    url, srv = server
    cfg = _cfg(arith_jsonl, f"rollout.controller_process={str(process).lower()}")
    rollouts = start_rollouts(cfg, srv.model_path, [url], str(tmp_path), go=True)
    try:
        assert isinstance(rollouts, ControllerProcess if process else LocalRollouts)
        rb = rollouts.next_batch(2, 0, timeout=300)
        assert rb.batch.num_seqs == 4 and rb.stats["staleness/max"] == 0
        assert rollouts.stats()["consumed"] == 2
    finally:
        rollouts.stop()


def test_servers_a_weight_update_retired_leave_generation(server, arith_jsonl, tmp_path) -> None:
    url, srv = server
    cfg = _cfg(arith_jsonl, "rollout.controller_process=false")
    rollouts = start_rollouts(cfg, srv.model_path, [url], str(tmp_path))
    assert isinstance(rollouts, LocalRollouts)
    control = ServerControl(rollouts, [ServerEndpoint(url)], client_factory(cfg, [url]))
    try:
        with pytest.raises(ValueError, match="not servers of this controller"):
            rollouts.retire(["http://127.0.0.1:1"])
        gen_clock = rollouts.controller.client.timeouts
        control.pause(cfg.generate.pause_mode)
        # the generation client's requests do not run out of time while the servers are paused
        assert gen_clock.paused and control.client.timeouts.paused
        control.client.servers[0].retired = True  # as when it missed a weight update
        control.resume(1)
        gen = rollouts.controller.client.servers[0]
        assert gen.retired and not gen.healthy and rollouts.stats()["version"] == 1
        assert not gen_clock.paused
    finally:
        control.close()
        rollouts.stop()


def test_pause_does_not_wait_for_a_busy_controller_loop(server, arith_jsonl, tmp_path) -> None:
    """Rank 0 pauses the rollouts before every weight update. A controller loop that is
    seconds behind (ingesting at full speed: the rollout-tier benchmark measured 32-61 s)
    must not hold the update up: no new prompts and the request clocks held, at once."""
    import time

    url, srv = server
    cfg = _cfg(arith_jsonl, "rollout.controller_process=false")
    rollouts = start_rollouts(cfg, srv.model_path, [url], str(tmp_path))
    try:
        rollouts.resume()
        busy = rollouts.controller.submit(lambda client: _hog_the_loop(3.0))
        time.sleep(0.2)  # the loop is inside the hog now
        t = time.perf_counter()
        rollouts.pause()
        took = time.perf_counter() - t
        assert took < 1.0, f"pause() waited {took:.1f} s for the controller's loop"
        assert rollouts.controller.client.timeouts.paused and rollouts.stats()["paused"]
        t = time.perf_counter()
        rollouts.resume()
        assert time.perf_counter() - t < 1.0 and not rollouts.controller.client.timeouts.paused
        busy.result(10)
    finally:
        rollouts.stop()


async def _hog_the_loop(seconds: float) -> None:
    import time

    time.sleep(seconds)  # blocks the event loop, as a burst of parsing and stitching does


async def _late_proxy(port: int, target: str, delay: float, seen: list[str], stop: "asyncio.Event") -> None:
    """Forward every request to ``target``, listening on ``port`` only after ``delay`` s (a
    server still loading its model)."""
    import aiohttp
    from aiohttp import web

    await asyncio.sleep(delay)
    session = aiohttp.ClientSession()

    async def forward(request: web.Request) -> web.Response:
        seen.append(request.path)
        async with session.request(request.method, target + request.path_qs, data=await request.read(),
                                   headers={"Content-Type": request.content_type}) as resp:
            return web.Response(body=await resp.read(), status=resp.status, content_type=resp.content_type)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await stop.wait()
    await runner.cleanup()
    await session.close()


@pytest.mark.parametrize("process", [True, False])
def test_started_with_go_waits_for_a_server_still_starting(server, arith_jsonl, tmp_path, process: bool) -> None:
    """The supervisor starts the trainer ranks beside the servers (launcher/supervisor.py),
    so a fresh run's rollouts may start before their server listens: they wait for its
    /health, and no request is lost to a refused connection."""
    import threading

    from realscale.parallel.net import free_port

    url, srv = server
    port = free_port("127.0.0.1")
    seen: list[str] = []
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete, args=(_late_proxy(port, url, 9.0, seen, stop),),
                              daemon=True)
    thread.start()
    cfg = _cfg(arith_jsonl, f"rollout.controller_process={str(process).lower()}")
    rollouts = start_rollouts(cfg, srv.model_path, [f"http://127.0.0.1:{port}"], str(tmp_path), go=True)
    try:
        rb = rollouts.next_batch(2, 0, timeout=300)
        assert rb.batch.num_seqs == 4 and rb.stats["staleness/max"] == 0
        stats = rollouts.stats()
        assert stats["failures"] == 0 and stats["servers_in_rotation"] == 1
        assert seen[0] == "/health" and "/generate" in seen
    finally:
        rollouts.stop()
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)


class _FilteringController:
    """Just what wait_for_groups reads: a batch limit, get_batch, last_group_at. Groups keep
    finishing (filtered out) every ``every`` seconds; the batch is ready at ``ready_at``
    (None: never)."""

    def __init__(self, limit: float, every: float | None, ready_at: float | None) -> None:
        import time
        from types import SimpleNamespace

        self._t0 = time.monotonic()
        self.last_group_at = self._t0
        self._every, self._ready_at = every, ready_at
        self.client = SimpleNamespace(timeouts=SimpleNamespace(batch_limit=lambda *a: limit))

    def get_batch(self, num_groups: int, timeout: float) -> list[str]:
        import time

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            now = time.monotonic()
            if self._ready_at is not None and now - self._t0 >= self._ready_at:
                return ["group"] * num_groups
            if self._every is not None and now - self.last_group_at >= self._every:
                self.last_group_at = now
            time.sleep(0.01)
        raise TimeoutError(f"get_batch: 0 of {num_groups} groups ready after {timeout} s")


def test_batch_wait_limits_time_without_a_finished_group_not_the_whole_wait() -> None:
    """The all-equal filter can reject most groups: a batch that keeps the servers busy for
    several batch limits is not hung as long as groups finish; one with no group finishing
    for the limit is, and the error says so."""
    from realscale.rollout.process import wait_for_groups

    cfg = load_config(None)
    busy = _FilteringController(limit=0.4, every=0.1, ready_at=1.2)  # 3x the limit, groups finishing
    assert wait_for_groups(busy, cfg, 2) == ["group", "group"]
    stuck = _FilteringController(limit=0.4, every=None, ready_at=None)
    with pytest.raises(TimeoutError, match="no group finished for 0 s, past the batch limit of 0 s"):
        wait_for_groups(stuck, cfg, 2)
    sliced = _FilteringController(limit=0.4, every=0.1, ready_at=1.2)  # the trainer's slices of POLL_S
    waited, got = 0.0, None
    while got is None:
        got = wait_for_groups(sliced, cfg, 2, poll_s=0.15, waited_s=waited)
        waited += 0.15
    assert got == ["group", "group"]
