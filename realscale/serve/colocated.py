"""Colocated generation (ReaL, arXiv 2406.14088): the trainer ranks generate, in a layout of their own.

A colocated run (``parallel.mode: colocated``, which a colocated plan sets) starts no
generation servers. Its ``T`` trainer ranks train and generate in turn, synchronously
(η = 0), each phase in its own layout: training in the trainer's ``(dp, tp, pp)``,
generation in ``d{G}t{g}`` with ``G * g = T`` (``generate.num_servers`` replicas of
``generate.tp`` ranks; replica ``i`` is trainer ranks ``[i*g, (i+1)*g)``, the trainer's
ranks being numbered in Megatron's order). One :class:`ColocatedGeneration` per rank; every
rank calls each method, in the same order:

- :meth:`~ColocatedGeneration.publish` (once at the start, then after every update): build
  the generation memory again if it was released (one flat weight buffer per rank in the
  generation layout's ``shard_index`` order, the decoder over views of it, its KV cache),
  then move the weights into it with the resharder: the plan and executor of the
  disaggregated weight world, with source and destination on the same ranks, so the rows a
  rank holds in both layouts are a local copy and only the rest crosses ranks (the bytes
  received are the lower bound).
- :meth:`~ColocatedGeneration.collect`: the generation phase. The first rank of each
  replica serves SGLang's HTTP routes with the embedded engine (continuous batching,
  sampling, weight-version tags) in threads of its trainer process, over
  :class:`~realscale.serve.ranks.ServerRanks` that are the replica's trainer ranks; the
  replica's other ranks run its forward passes (:func:`~realscale.serve.ranks.follow`).
  The driver's rollout controller, client and workflows are the disaggregated run's; they
  just talk to these servers. Once the driver holds B groups (η = 0: nothing is in flight
  then) it pauses the servers and ends the phase for every rank (a broadcast on a gloo
  group of the replicas' first ranks, which then release their followers). The generation
  memory is released (``parallel.release_idle_memory``) and training has the memory and
  every core to itself.

With ``parallel.release_idle_memory`` the models training needs but generation does not
(the frozen reference policy of the KL penalty: ``offload()`` / ``restore()``,
:mod:`realscale.train.reference`) are released from the start of ``publish`` to the end of
``collect``, so each phase holds only its own layout.

How this departs from ReaL: ReaL's generation is a call inside its model worker; ours keeps
SGLang's HTTP protocol between the rollout controller and the generating ranks (in-process,
on loopback), so that the rollout side (workflows, rewards, filters, request timeouts) is
exactly the disaggregated mode's. ReaL also offloads the idle model's state to host memory
between phases; here the generation side's buffers are freed and rebuilt. Moving the
optimizer state to host memory while generating is not written: on this CPU machine host
memory is the device memory, so it would free nothing (a GPU path that could not be run).
"""

from __future__ import annotations

import ctypes
import datetime
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch
import torch.distributed as dist

from realscale.models.convert import local_params
from realscale.parallel.device import comm_empty, local_device
from realscale.parallel.mesh import Layout, Mesh, Strategy
from realscale.parallel.model_spec import spec_from_hf_config
from realscale.parallel.net import advertised_host
from realscale.parallel.reshard import lower_bound_elems, plan_reshard
from realscale.parallel.reshard_exec import Resharder
from realscale.publish.weight_world import pack_megatron
from realscale.serve.decoder import ShardedDecoder, TPComm
from realscale.serve.ranks import RankWorker, ServerRanks, follow
from realscale.serve.weights import RankWeights

if TYPE_CHECKING:
    from realscale.config import Config
    from realscale.publish.control import ServerControl
    from realscale.serve.server import EmbeddedServer
    from realscale.train.engine import MegatronEngine

T = TypeVar("T")
# The first rank of each replica waits for the end of a phase, and idle followers for their
# next forward pass, on these groups: as long as generation may take, not a collective's timeout.
PHASE_TIMEOUT = datetime.timedelta(days=1)


def proc_status_mb(field: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak resident) of this process, MiB (Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def free_host_memory() -> None:
    """Return freed buffers to the OS now: glibc keeps freed heap memory for reuse (the
    next, equal, allocation would come from there), so RSS would not show the release.
    (No ``gc.collect()``: the buffers hold no reference cycles, so dropping them frees them,
    and a full collection of a trainer process costs about half a second.)"""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class ColocatedWorker(RankWorker):
    """A generation rank inside a trainer process: its weights and KV cache can be released
    between phases and built again (zeros; the resharder fills the weights)."""

    def __init__(self, model_dir: str, tp: int, tp_rank: int, comm: TPComm, *, dtype: torch.dtype,
                 device: torch.device, max_slots: int, max_len: int) -> None:
        super().__init__(model_dir, tp, tp_rank, comm, dtype=dtype, device=device, max_slots=max_slots,
                         max_len=max_len, load=False)
        self.comm, self.dtype, self.max_slots, self.max_len = comm, dtype, max_slots, max_len
        self.resident = True

    def release(self) -> None:
        self.weights = self.decoder = self.loader = None  # type: ignore[assignment]
        self.resident = False
        free_host_memory()

    def build(self) -> None:
        if self.resident:
            return
        self.weights = RankWeights.allocate(self.hf_dict, self.tp, self.tp_rank, self.dtype, self.device)
        self.decoder = ShardedDecoder(self.weights, self.hf_config, self.comm, self.max_slots, self.max_len)
        self.loader = self.weights.loader()
        self.resident = True


def _replica_groups(gen: Strategy, backend: str) -> tuple[list[Any], list[Any]]:
    """Every replica's control (gloo) and tensor-parallel groups, None for one-rank
    replicas. ``new_group`` is collective: every rank makes all of them, in replica order."""
    ctl: list[Any] = []
    comp: list[Any] = []
    for i in range(gen.dp):
        members = list(range(i * gen.tp, (i + 1) * gen.tp))
        ctl.append(dist.new_group(members, backend="gloo", timeout=PHASE_TIMEOUT) if gen.tp > 1 else None)
        comp.append(dist.new_group(members, backend=backend) if gen.tp > 1 else None)
    return ctl, comp


class ColocatedGeneration:
    """This trainer rank's part of the generation layout (module docstring). Its
    ``publish`` / ``close`` are :class:`~realscale.publish.publisher.WeightPublisher`'s."""

    def __init__(self, cfg: "Config", model_dir: str, engine: "MegatronEngine",
                 idle_while_generating: Sequence[Any | None] = ()) -> None:
        from realscale.publish.reshard import check_megatron_order

        check_megatron_order(engine)
        self.rank, world = dist.get_rank(), dist.get_world_size()
        g, r = cfg.generate, engine.ranks
        self.gen = Strategy(dp=g.num_servers, tp=g.tp, pp=1)
        self.replica, self.tp_rank = divmod(self.rank, self.gen.tp)
        self.release_idle = cfg.parallel.release_idle_memory
        self.idle_while_generating = [m for m in idle_while_generating if m is not None]
        self.dtype = engine.config.params_dtype
        self.spec = spec_from_hf_config(engine.hf_config, itemsize=self.dtype.itemsize)
        self.src = Layout(Mesh(0, world), r.strategy)
        dst = Layout(Mesh(0, world), self.gen)
        self.resharder = Resharder(plan_reshard(self.spec, self.src, dst, gpus_per_node=world))  # collective
        self.lower_bound = sum(lower_bound_elems(self.spec, self.src, dst).values()) * self.spec.itemsize
        ctl, comp = _replica_groups(self.gen, str(dist.get_backend()))
        self.ctl = ctl[self.replica]
        heads = [i * self.gen.tp for i in range(self.gen.dp)]
        self.phase_group = dist.new_group(heads, backend="gloo", timeout=PHASE_TIMEOUT)
        from realscale.serve.server import context_length_for

        max_len = context_length_for(model_dir, g.context_length)
        self.worker = ColocatedWorker(model_dir, self.gen.tp, self.tp_rank, TPComm(comp[self.replica]),
                                      dtype=self.dtype, device=local_device(), max_slots=g.max_running_requests,
                                      max_len=max_len)
        self.server: EmbeddedServer | None = None
        self._stop_http: Callable[[], None] | None = None
        url = self._serve(cfg, model_dir, max_len) if self.tp_rank == 0 else ""
        urls: list[str] = [""] * world
        dist.all_gather_object(urls, url)
        self.urls = [u for u in urls if u]  # the replicas' servers, in replica order
        self.control: ServerControl | None = None  # the driver's, once its controller exists
        self._rss_train = float("nan")
        if self.release_idle:
            self.worker.release()

    def _serve(self, cfg: "Config", model_dir: str, max_len: int) -> str:
        """The replica's first rank: an embedded server over this replica's ranks, paused
        until the first phase, on a port the OS picks; its URL."""
        from realscale.serve.server import EmbeddedServer, start_in_thread

        g = cfg.generate
        ranks = ServerRanks.of_running(self.worker, self.ctl, max_len)
        self.server = EmbeddedServer(model_dir, max_running=g.max_running_requests, context_length=g.context_length,
                                     seed=cfg.run.seed + self.replica, dtype=str(self.dtype).removeprefix("torch."),
                                     ranks=ranks)
        self._on_engine(lambda e: e.pause("abort"))
        url, self._stop_http = start_in_thread(self.server, g.host, 0)
        return f"http://{advertised_host(g.host)}:{url.rsplit(':', 1)[1]}"

    def _on_engine(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(engine)`` on the scheduler thread, between forward passes."""
        assert self.server is not None
        engine = self.server.engine
        return engine.call(lambda: fn(engine)).result(timeout=600)

    # ------------------------------------------------------------------ the two phases

    def publish(self, engine: "MegatronEngine", version: int) -> dict[str, float]:
        """Every rank: the trainer's weights into the generation layout, tagged ``version``."""
        from realscale.publish.transport import sum_over_ranks

        start = time.perf_counter()
        self._rss_train = proc_status_mb("VmRSS")  # after the update, before the generation memory returns
        if self.release_idle:
            for model in self.idle_while_generating:
                model.offload()
        self.worker.build()
        src_buf = comm_empty(self.resharder.src_idx.numel, self.dtype, self.resharder.comm.backend)
        pack_megatron(local_params(engine.model), self.spec, self.src, self.rank, src_buf)
        _, st = self.resharder.run(src_buf, out=self.worker.weights.flat)
        del src_buf
        if self.server is not None:
            self._on_engine(lambda e: setattr(e, "weight_version", str(version)))
        if self.control is not None:
            self.control.rollouts.set_version(version)
        received, local = sum_over_ranks([st.recv_bytes, st.local_bytes])
        return {"perf/weight_sync_s": time.perf_counter() - start, "perf/weight_sync_bytes": float(received),
                "perf/weight_sync_bytes_lower_bound": float(self.lower_bound),
                "perf/weight_sync_local_bytes": float(local)}

    def collect(self, wait: Callable[[], T] | None) -> tuple[T | None, dict[str, float]]:
        """Every rank: one generation phase. ``wait`` is the driver's (B groups from the
        rollout controller) and ends it; the driver gets its result, the others None."""
        start = time.perf_counter()
        self.worker.build()
        result = None
        if self.tp_rank > 0:
            follow(self.ctl, self.worker, self.gen.tp)  # until the replica's first rank says stop
        else:
            self._on_engine(lambda e: e.resume())
            result = self._drive(wait) if self.control is not None else None
            dist.broadcast_object_list([None], src=0, group=self.phase_group)  # the driver: the phase is over
            self._on_engine(lambda e: e.pause("abort"))
            assert self.server is not None
            self.server.ranks.stop_followers()
        rss_gen = proc_status_mb("VmRSS")
        if self.release_idle:
            self.worker.release()
            for model in self.idle_while_generating:
                model.restore()
        return result, {"perf/generate_s": time.perf_counter() - start, **self._memory(rss_gen)}

    def _drive(self, wait: Callable[[], T] | None) -> T | None:
        """The driver: let the controller submit until ``wait`` returns, then pause the
        servers (η = 0: nothing is in flight by then)."""
        assert self.control is not None and wait is not None
        self.control.rollouts.resume()
        try:
            return wait()
        finally:
            self.control.pause("abort")

    def _memory(self, rss_gen: float) -> dict[str, float]:
        """Resident memory of every rank (MiB): after the update (``rss_train``), at the end
        of generation (``rss_generate``) and the process's peak so far (``peak_rss``)."""
        mine = (self._rss_train, rss_gen, proc_status_mb("VmHWM"))
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        out: dict[str, float] = {}
        for rank, values in enumerate(every):
            for name, v in zip(("rss_train", "rss_generate", "peak_rss"), values):
                out[f"mem/{name}_mb_rank{rank}"] = v
        return out

    def close(self) -> None:
        if self._stop_http is not None:
            self._stop_http()  # the server's cleanup stops its engine (the ranks are not its to stop)
            self._stop_http = None
