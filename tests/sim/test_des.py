"""The discrete-event simulator: exact small cases, the staleness invariants, conservation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from realscale.rollout.staleness import StalenessManager
from realscale.sim.des import ServerModel, SimConfig, SimError, Simulation, TrainerModel, simulate
from realscale.sim.workload import AcceptFraction, Histogram, Lognormal, Workload, WorkloadError

STEP = 0.01  # decode step seconds
TRAIN = 0.5
SYNC = 0.1


def _server(**kw) -> ServerModel:
    return ServerModel(lambda b, ctx: STEP, lambda tokens, reqs: 0.0, **kw)


def _trainer(per_token: float = 0.0) -> TrainerModel:
    return TrainerModel(lambda n, p, a: TRAIN + per_token * a, SYNC)


def _fixed(length: int, batch: int = 1, n: int = 4, cap: int = 1000) -> Workload:
    return Workload(batch, n, 10, cap, Histogram((length,), (1.0,)))


def test_synchronous_step_is_generate_then_train_then_sync() -> None:
    """One group of 4 answers of 50 tokens, one server: 50 decode steps + train + sync."""
    res = simulate(SimConfig(_fixed(50), eta=0, n_servers=1, steps=3, warmup=1), _server(), _trainer())
    assert res.step_seconds == pytest.approx(50 * STEP + TRAIN + SYNC)
    assert res.tokens_per_s == pytest.approx(4 * 50 / (50 * STEP + TRAIN + SYNC))
    assert res.idle["generate"] == pytest.approx((TRAIN + SYNC) / res.step_seconds)
    assert res.idle["train"] == pytest.approx(50 * STEP / res.step_seconds)
    assert res.staleness_hist == {0: 3 * 4 // 4}


def test_asynchronous_overlaps_generation_with_training() -> None:
    """With eta=1 the next batch generates while the trainer trains: the step is the longer
    of the two (plus the sync, during which servers are paused)."""
    res = simulate(SimConfig(_fixed(50), eta=1, n_servers=1, steps=8, warmup=3), _server(), _trainer())
    assert res.step_seconds == pytest.approx(max(50 * STEP, TRAIN) + SYNC, rel=1e-6)
    assert max(res.staleness_hist) <= 1


def test_continuous_batching_fills_slots() -> None:
    """Two groups on one server with 8 slots decode together; with 4 slots, one after the other."""
    w = _fixed(50, batch=2)
    wide = simulate(SimConfig(w, eta=0, n_servers=1, steps=2, warmup=1), _server(max_running=8), _trainer())
    narrow = simulate(SimConfig(w, eta=0, n_servers=1, steps=2, warmup=1), _server(max_running=4), _trainer())
    assert wide.step_seconds == pytest.approx(50 * STEP + TRAIN + SYNC)
    assert narrow.step_seconds == pytest.approx(100 * STEP + TRAIN + SYNC)


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
def test_staleness_bound_holds_and_uses_the_real_manager(eta: int) -> None:
    """Every trained group lags at most eta versions; the capacity rule is the controller's object."""
    w = Workload(4, 4, 10, 400, Lognormal(40, 1.0), AcceptFraction(0.5))
    sim = Simulation(SimConfig(w, eta=eta, n_servers=2, steps=20, warmup=2, max_concurrent=32), _server(), _trainer())
    assert isinstance(sim.mgr, StalenessManager)
    res = sim.run()
    assert max(res.staleness_hist) <= eta
    assert sum(res.staleness_hist.values()) == 20 * 4
    assert all(r.max_staleness <= eta for r in res.timeline)


def test_async_beats_sync_on_a_long_tail() -> None:
    w = Workload(8, 4, 10, 2000, Lognormal(30, 1.2))
    sync = simulate(SimConfig(w, eta=0, n_servers=1, steps=12, warmup=2), _server(), _trainer(1e-4))
    asyn = simulate(SimConfig(w, eta=4, n_servers=1, steps=12, warmup=2), _server(), _trainer(1e-4))
    assert asyn.tokens_per_s > 1.3 * sync.tokens_per_s


def test_kv_budget_retracts_and_conserves_tokens() -> None:
    """A KV cache that holds about two answers: requests wait or are retracted and resumed,
    and every answer still gets exactly its length."""
    w = _fixed(100, batch=2, n=4, cap=110)
    server = ServerModel(lambda b, ctx: STEP, lambda t, r: 0.0, kv_tokens=240, reserve_ratio=0.0)
    sim = Simulation(SimConfig(w, eta=0, n_servers=1, steps=2, warmup=1), server, _trainer())
    res = sim.run()
    assert res.mean_generated_len == pytest.approx(100)
    assert sim.gen_tokens_done == sim.finished * 100  # nothing decoded twice or lost
    # 8 answers at once would take 100 steps; 240 tokens hold about 4 half-done answers
    assert res.step_seconds > 2 * 100 * STEP + TRAIN + SYNC


def test_recompute_interrupt_costs_prefill() -> None:
    """AReaL's interruption: requests running at a weight update are prefilled again."""
    w = _fixed(400, batch=1, n=4)
    prefill = ServerModel(lambda b, ctx: STEP, lambda t, r: 1e-3 * t)
    keep = simulate(SimConfig(w, eta=2, n_servers=1, steps=6, warmup=2, interrupt="in_place"), prefill, _trainer())
    redo = simulate(SimConfig(w, eta=2, n_servers=1, steps=6, warmup=2, interrupt="recompute"), prefill, _trainer())
    assert redo.step_seconds > keep.step_seconds


def test_colocated_needs_eta_zero_and_counts_shared_idle() -> None:
    with pytest.raises(SimError, match="eta must be 0"):
        SimConfig(_fixed(10), eta=1, n_servers=1, colocated=True)
    res = simulate(SimConfig(_fixed(50), eta=0, n_servers=1, steps=3, warmup=1, colocated=True, switch_seconds=0.2),
                   _server(), _trainer())
    assert res.step_seconds == pytest.approx(50 * STEP + TRAIN + 0.2 + SYNC)
    assert set(res.idle) == {"all"} and res.idle["all"] == pytest.approx(0.0, abs=1e-9)


def test_a_shared_host_slows_only_what_overlaps() -> None:
    """Processor sharing on host cores: the synchronous run never overlaps generation with
    training, so one core changes nothing; the asynchronous one overlaps them, so on one
    core the overlapped work runs at half speed, and on two cores (no client cost) at full."""
    w = _fixed(50)
    kw = dict(n_servers=1, steps=8, warmup=3)
    sync = simulate(SimConfig(w, eta=0, host_cores=1.0, **kw), _server(), _trainer())
    assert sync.step_seconds == pytest.approx(50 * STEP + TRAIN + SYNC)
    free = simulate(SimConfig(w, eta=1, **kw), _server(), _trainer())
    two = simulate(SimConfig(w, eta=1, host_cores=2.0, **kw), _server(), _trainer())
    one = simulate(SimConfig(w, eta=1, host_cores=1.0, **kw), _server(), _trainer())
    assert two.step_seconds == pytest.approx(free.step_seconds)
    assert one.step_seconds > 1.1 * free.step_seconds
    # the client's CPU per request is demand too: with enough of it two cores are short
    busy = simulate(SimConfig(w, eta=1, host_cores=2.0, client_cpu_per_request=0.5, **kw), _server(), _trainer())
    assert busy.step_seconds > free.step_seconds


def test_the_trainer_is_slowed_only_while_a_server_decodes_beside_it() -> None:
    """One core, η = 1: after each weight update the server gets the next group (10 steps
    of STEP) while the trainer starts its step. Both run at half speed until the group is
    done (0.2 s, the trainer 0.1 s along), then the trainer alone: TRAIN + 10·STEP. A
    speed fixed when the step starts would give TRAIN (server seen idle) or 2·TRAIN."""
    res = simulate(SimConfig(_fixed(10), eta=1, n_servers=1, steps=6, warmup=2, host_cores=1.0), _server(), _trainer())
    for t in res.timeline[2:]:
        assert t.train_end - t.batch_ready == pytest.approx(TRAIN + 10 * STEP)


def test_padded_server_decodes_at_its_longest_context() -> None:
    """A padded server's step attends over the longest running context, a paged one over the mean."""
    w = _fixed(50, n=2)
    for padded, want in ((False, (10 + 30) / 2), (True, 30.0)):
        sim = Simulation(SimConfig(w, eta=0, n_servers=1), ServerModel(lambda b, c: STEP, lambda t, r: 0.0,
                                                                      padded=padded), _trainer())
        sim._refill()
        srv = sim.servers[0]
        a, b = list(srv.running.values())
        a.base, b.base = 0, 20  # one request 20 tokens further than the other
        srv.ctx_sum = 2 * 10 + 20
        assert sim._context(srv) == pytest.approx(want)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(SimError, match="does not fit"):
        Simulation(SimConfig(_fixed(10, cap=100), eta=0, n_servers=1), ServerModel(lambda b, c: 1, lambda t, r: 0,
                                                                                    kv_tokens=50), _trainer())
    with pytest.raises(SimError, match="warmup"):
        SimConfig(_fixed(10), eta=0, n_servers=1, steps=2, warmup=2)
    with pytest.raises(WorkloadError):
        Lognormal(-1, 0.5)
    with pytest.raises(WorkloadError):
        Histogram((1, 2), (1.0,))


def test_lognormal_is_cut_at_the_cap() -> None:
    x = Lognormal(1000, 1.0).sample(np.random.default_rng(0), 10000, 2000)
    assert x.max() == 2000 and x.min() >= 1
    assert math.isclose(np.median(x), 1000, rel_tol=0.05)


def test_server_model_from_the_cost_model_keeps_its_fields() -> None:
    """The cost-model server: tp GPUs, SGLang's admission reserve, a KV budget from the GPU's memory."""
    from realscale.parallel.model_spec import known_model
    from realscale.planner.hardware import builtin_profile
    from realscale.sim.build import SGLANG_RESERVE_RATIO, server_model

    for tp in (1, 8):
        sm = server_model(known_model("qwen2-32b" if tp == 8 else "qwen2-1.5b"), builtin_profile("H800"), tp, 1024,
                          max_running=256)
        assert (sm.gpus, sm.reserve_ratio, sm.max_running) == (tp, SGLANG_RESERVE_RATIO, 256)
        assert 1e5 < sm.kv_tokens < 1e8
