"""The rollout controller: keeps generation busy within the staleness bound.

The trainer is synchronous; the controller runs its own asyncio loop in a background
thread. That loop owns the :class:`~realscale.inference.client.InferenceClient` and keeps
up to ``StalenessManager.capacity(version)`` prompts in flight, one
``workflow.run_episode`` task per prompt. A finished group goes through the filters and
into a FIFO buffer; :meth:`RolloutController.get_batch` hands the oldest accepted groups
to the trainer.

Filters, in order:

- *failed*: the episode raised (a server error after the client's retries). Counted, and
  the prompt is re-queued after a back-off. ``max_consecutive_failures`` failures with no
  success between them mean the servers are gone: :meth:`get_batch` raises
  :class:`RolloutError` naming the last error. With ``outages_handled`` (the trainer's
  rollouts) a failure because no server is in rotation at all (every one dead) does not
  count towards that: it is an outage, which trainer rank 0 sees (:meth:`rotation`) and
  ends by republishing the weights to the servers the launcher started again, or fails
  loudly (:mod:`realscale.publish.outage`).
- *stale*: the group's oldest token lags the current version by more than η. With the
  batching rule below this cannot happen while versions move one at a time; it stays as
  the safety net for a trainer that skips versions. Such a group can never be trained
  within the bound, so it is dropped and its prompt re-queued. :meth:`set_version`
  applies the same check to the buffer. Hence every group :meth:`get_batch` returns has
  ``version_at_train - min_version <= η``.
- *all_equal* (``filter_all_equal``, DAPO dynamic sampling): a group whose rewards are
  all equal teaches nothing; it is dropped for good and a replacement prompt drawn.

Batching (:meth:`get_batch`), oldest submission first, with a deadline. At version V a
group submitted at version ``s <= V - η`` must be trained now: at V + 1 it would lag more
than η. The capacity rule admits at most ``(V + 1)·B`` groups with ``s <= V - η`` over the
whole run and ``V·B`` were trained before, so at most B such *due* groups exist and they
fit one batch. ``get_batch`` therefore returns the B buffered groups with the oldest
submission, and waits while a due group is still generating. So a long episode is never
thrown away for staleness (which would bias training towards short answers); the
trainer waits for it instead, and that wait is the price of the bound. η = 0 makes every
running group due: the synchronous step. (AReaL enforces η only through the capacity
rule; a late episode there is trained beyond the bound.)

Checkpoints (:meth:`state_dict`): in-flight and buffered groups are not saved; a resumed
run regenerates them. Every sample drawn from the dataset gets a sequence number and
stays *pending* until the trainer consumes its group (or the filter drops it for good).
The state holds the dataset position as of the last sample drawn plus the uids of all
pending samples, in draw order. On resume those uids are issued first, then the dataset
continues where it stood: each sample is trained exactly once across the restart, none
skipped, none repeated. The dataset position and the pending set change together under
one lock, so a snapshot is always consistent. The saved staleness counters count only
consumed groups as accepted (the regenerated ones will be accepted again).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from realscale.data.dataset import PromptSample
from realscale.data.groups import Group
from realscale.inference.client import InferenceClient, NoServerError, dialect_for
from realscale.rollout.staleness import StalenessManager
from realscale.rollout.workflows import Workflow

if TYPE_CHECKING:
    from realscale.config import Config, GenerateConfig
    from realscale.data.dataset import PromptDataset

log = logging.getLogger(__name__)


class RolloutError(RuntimeError):
    """Rollouts cannot go on (servers gone, controller stopped)."""


class RolloutExhausted(RolloutError):
    """The dataset ran out before the requested batch could be filled."""


class RolloutController:
    """Asynchronous rollouts for a synchronous trainer.

    Args:
        client: a factory returning an (unstarted) InferenceClient, or server URLs.
        dataset: yields :class:`PromptSample` s; ``state_dict``/``load_state_dict`` for
            checkpoints, ``samples`` to find pending samples again by uid on resume.
        workflow: turns one sample into its group (``run_episode``).
        staleness: the capacity rule (batch size B, bound η, most prompts in flight).
        filter_all_equal: drop groups whose rewards are all equal (DAPO).
        max_ahead: most groups ahead of the trainer, buffered or in flight (0: no limit
            beyond η and ``max_concurrent``). Within the bound the controller otherwise runs
            as far ahead as η allows, so when generation outpaces training every trained
            group is η versions old; ``max_ahead = 2·B`` keeps about one batch ready and
            one generating instead.
        max_consecutive_failures: failed episodes in a row before get_batch raises.
        retry_backoff: seconds before a failed prompt is tried again (doubles per
            consecutive failure, at most 30 s).
        version: the weight version the servers start at.
        client_kwargs: InferenceClient options when ``client`` is a list of URLs.

    ``outages_handled`` (an attribute, False unless set): failures while no server is in
    rotation do not count towards ``max_consecutive_failures`` (module docstring).
    """

    def __init__(self, client: Callable[[], InferenceClient] | Sequence[str], dataset: Any, workflow: Workflow,
                 staleness: StalenessManager, *, filter_all_equal: bool = False, max_consecutive_failures: int = 8,
                 retry_backoff: float = 0.5, version: int = 0, client_kwargs: dict[str, Any] | None = None,
                 max_ahead: int = 0) -> None:
        if max_consecutive_failures < 1:
            raise ValueError(f"max_consecutive_failures must be >= 1, got {max_consecutive_failures}")
        if max_ahead < 0:
            raise ValueError(f"max_ahead must be >= 0 (0: no limit), got {max_ahead}")
        if 0 < max_ahead < staleness.batch_size:
            raise ValueError(f"max_ahead ({max_ahead}) must be 0 or at least the batch size ({staleness.batch_size}): "
                             "a batch could never fill")
        self.max_ahead = int(max_ahead)
        self._client_factory = _client_factory(client, client_kwargs or {})
        self.dataset = dataset
        self.workflow = workflow
        self.staleness = staleness
        self.filter_all_equal = filter_all_equal
        self.max_consecutive_failures = int(max_consecutive_failures)
        self.retry_backoff = float(retry_backoff)
        self.client: InferenceClient | None = None
        self.outages_handled = False

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._version = int(version)
        self._paused = False
        self._iter: Iterator[PromptSample] | None = None
        self._exhausted = False
        self._seq = 0
        self._pending: dict[int, PromptSample] = {}  # drawn, not yet consumed: seq -> sample
        self._requeue: list[tuple[int, PromptSample]] = []  # heap by seq: oldest re-issued first
        self._delayed = 0  # failed prompts waiting out their back-off
        self._buffer: collections.deque[tuple[int, Group]] = collections.deque()
        self._consumed = 0
        self._rejected: collections.Counter[str] = collections.Counter()
        # Model tokens of every finished group, trained or filtered out: what the servers did
        # (trained tokens alone hide the work the filters throw away).
        self._generated_tokens = 0
        # When a group last finished (trained or filtered out): a trainer's wait for a batch
        # is limited by the time without one (process.wait_for_groups), since a filter that
        # rejects most groups makes a healthy batch take many rounds of generation.
        self.last_group_at = time.monotonic()
        self._failures: collections.Counter[str] = collections.Counter()
        self._consecutive_failures = 0
        self._fatal: RolloutError | None = None
        self._lag_hist: collections.Counter[int] = collections.Counter()
        self._submit_versions: collections.Counter[int] = collections.Counter()
        self._running_versions: collections.Counter[int] = collections.Counter()  # in flight, by submit version
        self._due_waits = 0  # get_batch calls that waited for a due group still generating

        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wake: asyncio.Event | None = None
        self._main: asyncio.Future | None = None
        self._tasks: set[asyncio.Task] = set()
        self._started = False
        self._stopped = False

    @classmethod
    def from_config(cls, cfg: "Config", client: Callable[[], Any] | Sequence[str], dataset: "PromptDataset",
                    workflow: Workflow, *, version: int = 0) -> "RolloutController":
        """A controller set up by ``cfg.rollout`` (and ``cfg.generate`` for the client)."""
        r = cfg.rollout
        return cls(client, dataset, workflow, StalenessManager(r.batch_size, r.max_staleness, r.max_concurrent),
                   filter_all_equal=r.filter_all_equal, max_consecutive_failures=r.max_consecutive_failures,
                   version=version, client_kwargs=client_kwargs(cfg), max_ahead=r.max_ahead)

    # ================================================================== trainer API

    def start(self, timeout: float = 60.0) -> None:
        """Start the loop thread, the client, and submitting prompts."""
        if self._started:
            raise RuntimeError("RolloutController.start: already started")
        self._started = True
        self._iter = iter(self.dataset)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-controller", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open_client(), self._loop).result(timeout)
        self._main = asyncio.run_coroutine_threadsafe(self._submit_loop(), self._loop)
        self._main.add_done_callback(self._on_main_done)

    def get_batch(self, num_groups: int, timeout: float | None = None) -> list[Group]:
        """The ``num_groups`` accepted groups submitted first, once no group that is due at
        this version is still generating (module docstring, "Batching"); blocks up to
        ``timeout`` seconds (None: forever). Raises TimeoutError, RolloutError, or
        RolloutExhausted."""
        if num_groups < 1:
            raise ValueError(f"get_batch: num_groups must be >= 1, got {num_groups}")
        self._require_started("get_batch")
        deadline = None if timeout is None else time.monotonic() + timeout
        waited_for_due = False
        with self._cond:
            while True:
                if self._fatal is not None:
                    raise self._fatal
                due = self._due_running_locked()
                if len(self._buffer) >= num_groups and not due:
                    return self._take(num_groups)
                if due and not waited_for_due:
                    waited_for_due = True
                    self._due_waits += 1
                if self._stopped:
                    raise RolloutError("get_batch: the rollout controller was stopped")
                if self._exhausted and not self._pending_work():
                    raise RolloutExhausted(f"get_batch: the dataset is exhausted; {len(self._buffer)} of "
                                           f"{num_groups} groups are ready and no more will come")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(self._timeout_message(num_groups, timeout))
                self._cond.wait(left)

    def set_version(self, version: int) -> None:
        """The servers now run weight version ``version``: capacity grows, and buffered
        groups that can no longer be trained within the bound are re-queued."""
        with self._lock:
            if version < self._version:
                raise ValueError(f"set_version: version went back from {self._version} to {version}")
            self._version = int(version)
            self._evict_stale_locked()
        self._poke()

    def pause(self) -> None:
        """Stop submitting new prompts (in-flight episodes go on); for weight updates. The
        servers are about to be paused (by rank 0's server control): the client's health
        check stops probing them until :meth:`resume` (SGLang's /health would generate)."""
        with self._lock:
            self._paused = True
            if self.client is not None:
                self.client.servers_paused = True

    def resume(self) -> None:
        """Submit prompts again (the servers were resumed)."""
        with self._lock:
            self._paused = False
            if self.client is not None:
                self.client.servers_paused = False
        self._poke()

    def call(self, fn: Callable[[Any], Any], timeout: float | None = 600.0) -> Any:
        """Run coroutine ``fn(client)`` on the controller's loop and wait for its result,
        e.g. ``ctl.call(lambda c: c.pause())`` around a weight update."""
        return self.submit(fn).result(timeout)

    def submit(self, fn: Callable[[Any], Any]) -> "concurrent.futures.Future[Any]":
        """Start coroutine ``fn(client)`` on the controller's loop; its future, at once
        (a weight transfer posts to the servers while this thread takes part in it)."""
        self._require_started("submit")
        return asyncio.run_coroutine_threadsafe(_await(fn, self.client), self._loop)

    def retire_servers(self, urls: Sequence[str], timeout: float = 60.0) -> None:
        """Generate on these servers no more: a weight update could not reach them, so they
        would serve old weights under the new version (rank 0's server control, which
        sends the updates with its own client, says which)."""
        self._require_started("retire_servers")
        asyncio.run_coroutine_threadsafe(self._retire(set(urls)), self._loop).result(timeout)

    def admit_servers(self, urls: Sequence[str], timeout: float = 60.0) -> None:
        """Generate on these servers too: restarted ones a weight update has just reached
        (they hold the current version; rank 0's server control says which)."""
        self._require_started("admit_servers")
        asyncio.run_coroutine_threadsafe(self._admit(list(urls)), self._loop).result(timeout)

    def rotation(self) -> list[str]:
        """URLs of the servers requests go to now (in rotation: healthy, not retired)."""
        if self.client is None:
            return []
        return [s.url for s in list(self.client.servers) if s.healthy and not s.retired]

    @property
    def version(self) -> int:
        return self._version

    def stats(self) -> dict[str, Any]:
        """Counters for the step log (a snapshot)."""
        with self._lock:
            st = self.staleness
            return {"version": self._version, "submitted": st.submitted, "accepted": st.accepted,
                    "rejected": sum(self._rejected.values()), "rejected_by_reason": dict(self._rejected),
                    "failures": sum(self._failures.values()), "failures_by_type": dict(self._failures),
                    "running": st.running, "buffer": len(self._buffer), "consumed": self._consumed,
                    "requeued": len(self._requeue) + self._delayed, "capacity": st.capacity(self._version),
                    "due_waits": self._due_waits, "generated_tokens": self._generated_tokens,
                    "paused": self._paused, "exhausted": self._exhausted,
                    **self._occupancy(),
                    "staleness_hist": dict(sorted(self._lag_hist.items())),
                    "submitted_by_version": dict(sorted(self._submit_versions.items()))}

    def _occupancy(self) -> dict[str, int]:
        """The most requests in flight at once since the last stats, in all and on one
        server (``rollout/inflight``), and the servers still in rotation."""
        if self.client is None:
            return {"inflight": 0, "inflight_server_max": 0, "servers_in_rotation": 0}
        total, per_server = self.client.take_peaks()
        return {"inflight": total, "inflight_server_max": per_server,
                "servers_in_rotation": sum(not s.retired for s in self.client.servers)}

    def state_dict(self) -> dict[str, Any]:
        """Dataset position + pending sample uids + counters (see the module docstring)."""
        with self._lock:
            stale = self.staleness.state_dict()
            stale["accepted"] -= len(self._buffer)  # buffered groups are regenerated on resume
            return {"dataset": self.dataset.state_dict(),
                    "pending_uids": [s.uid for _, s in sorted(self._pending.items(), key=lambda kv: kv[0])],
                    "staleness": stale, "version": self._version, "consumed": self._consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (before :meth:`start`)."""
        if self._started:
            raise RuntimeError("RolloutController.load_state_dict: call it before start()")
        by_uid = _uid_index(self.dataset, state["pending_uids"])
        self.dataset.load_state_dict(state["dataset"])
        self.staleness.load_state_dict(state["staleness"])
        self._version = int(state["version"])
        self._consumed = int(state.get("consumed", 0))
        self._pending.clear()
        self._requeue = []
        for seq, uid in enumerate(state["pending_uids"]):
            self._pending[seq] = by_uid[uid]
            self._requeue.append((seq, by_uid[uid]))  # ascending seq: already a heap
        self._seq = len(state["pending_uids"])

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel in-flight episodes, close the client, end the loop thread."""
        if not self._started or self._stopped:
            self._stopped = True
            return
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._loop.close()

    def __enter__(self) -> "RolloutController":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ================================================================== loop side

    async def _open_client(self) -> None:
        self._wake = asyncio.Event()
        self.client = self._client_factory()
        with self._lock:
            self.client.servers_paused = self._paused
        await self.client.start()

    async def _retire(self, urls: set[str]) -> None:
        known = {s.url for s in self.client.servers}
        if urls - known:
            raise ValueError(f"retire_servers: {sorted(urls - known)} are not servers of this controller ({sorted(known)})")
        for server in self.client.servers:
            if server.url in urls:
                server.retired, server.healthy = True, False

    async def _admit(self, urls: list[str]) -> None:
        for url in urls:
            self.client.add_server(url, pending=False)
        self._wake.set()  # room for more requests now

    async def _submit_loop(self) -> None:
        """Top up to capacity whenever something changes; runs until stop()."""
        while not self._stopped:
            for sample_seq in self._draw():
                seq, sample, version = sample_seq
                task = asyncio.get_running_loop().create_task(self._episode(seq, sample, version))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            await self._wake.wait()
            self._wake.clear()

    def _draw(self) -> list[tuple[int, PromptSample, int]]:
        """Samples to submit now (requeued first), registered as running."""
        out = []
        with self._lock:
            if self._paused or self._fatal is not None:
                return out
            room = self.staleness.capacity(self._version)
            if self.max_ahead:  # enough is ahead: what is submitted later is generated by newer weights
                room = min(room, self.max_ahead - len(self._buffer) - self.staleness.running)
            for _ in range(room):
                item = self._next_sample_locked()
                if item is None:
                    break
                self.staleness.on_submit()
                self._submit_versions[self._version] += 1
                self._running_versions[self._version] += 1
                out.append((*item, self._version))
        return out

    def _next_sample_locked(self) -> tuple[int, PromptSample] | None:
        if self._requeue:
            return heapq.heappop(self._requeue)
        if self._exhausted:
            return None
        try:
            sample = next(self._iter)
        except StopIteration:
            self._exhausted = True
            self._cond.notify_all()  # a waiting get_batch may now know it cannot be served
            return None
        seq, self._seq = self._seq, self._seq + 1
        self._pending[seq] = sample
        return seq, sample

    async def _episode(self, seq: int, sample: PromptSample, version: int) -> None:
        try:
            trajectories = await self.workflow.run_episode(self.client, sample)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one episode's failure must not stop the run
            self._on_failure(seq, sample, version, exc)
            return
        try:
            group = Group(trajectories, uid=sample.uid, submit_version=version)
            verdict = self._verdict(group)
        except Exception as exc:  # noqa: BLE001 - a defect here: the group would never finish
            # Not retried like a failed episode (the same group would fail again), and not left
            # to the batch limit: a group that never finishes holds every batch that is due
            # with it, so the run would wait minutes for a timeout that names nothing.
            log.error("rollout controller: the group of %s could not be judged", sample.uid or "?", exc_info=exc)
            error = RolloutError(f"the group of {sample.uid or '?'} could not be judged: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self._set_fatal(error)
            return
        if group.min_version < version:
            self._set_fatal(RolloutError(
                f"a server tagged tokens of {sample.uid or '?'} with weight version {group.min_version}, but the "
                f"prompt was submitted at version {version}: call set_version(v) only after every server runs "
                f"version v (a server that missed a weight update must be updated before it serves again)"))
            return
        with self._cond:
            self._finished_locked(version)
            self._consecutive_failures = 0
            self.last_group_at = time.monotonic()
            self._generated_tokens += sum(sum(t.loss_mask) for t in trajectories)
            if verdict == "accept" and self._too_stale_locked(group):
                verdict = "stale"
            if verdict == "accept":
                self.staleness.on_accept()
                self._buffer.append((seq, group))
            else:
                self.staleness.on_reject()
                self._rejected[verdict] += 1
                if verdict == "stale":
                    heapq.heappush(self._requeue, (seq, sample))
                else:
                    self._pending.pop(seq, None)  # filtered for good: this sample is done
        self._wake.set()

    def _verdict(self, group: Group) -> str:
        """'accept' or the filter's reason to drop the group."""
        if self.filter_all_equal and len(group) > 0:
            import torch

            from realscale.algo.filtering import dynamic_sampling_filter

            result = dynamic_sampling_filter(torch.tensor(group.rewards, dtype=torch.float64), len(group))
            if result.n_all_equal:
                return "all_equal"
        return "accept"

    def _set_fatal(self, error: RolloutError) -> None:
        with self._cond:
            if self._fatal is None:
                self._fatal = error
            self._cond.notify_all()

    def _on_failure(self, seq: int, sample: PromptSample, version: int, exc: Exception) -> None:
        # no server in rotation at all: an outage that trainer rank 0 ends (module docstring), not a failing server
        outage = self.outages_handled and isinstance(exc, NoServerError) and not self.rotation()
        with self._cond:
            self._finished_locked(version)
            self.staleness.on_reject()
            self._failures[type(exc).__name__] += 1
            self._consecutive_failures += not outage
            n = max(1, self._consecutive_failures)
            if n >= self.max_consecutive_failures and self._fatal is None and not outage:
                self._fatal = RolloutError(f"{n} episodes failed in a row; the generation servers look "
                                           f"unreachable. Last error: {type(exc).__name__}: {exc}")
                self._fatal.__cause__ = exc
                self._cond.notify_all()
            self._delayed += 1
        log.warning("episode for %s failed (%r); retrying it", sample.uid or "?", exc)
        delay = min(30.0, self.retry_backoff * 2 ** (n - 1))
        self._loop.call_later(delay, self._requeue_after_backoff, seq, sample)

    def _on_main_done(self, fut: Any) -> None:
        """A crash of the submit loop is a bug; surface it to the trainer, never hang."""
        if fut.cancelled() or fut.exception() is None:
            return
        with self._cond:
            self._fatal = RolloutError(f"the rollout submit loop crashed: {fut.exception()!r}")
            self._fatal.__cause__ = fut.exception()
            self._cond.notify_all()

    def _requeue_after_backoff(self, seq: int, sample: PromptSample) -> None:
        with self._lock:
            self._delayed -= 1
            heapq.heappush(self._requeue, (seq, sample))
        self._wake.set()

    async def _shutdown(self) -> None:
        self._wake.set()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._main is not None:
            await asyncio.gather(asyncio.wrap_future(self._main), return_exceptions=True)
        if self.client is not None:
            await self.client.close()

    # ================================================================== helpers (lock held)

    def _too_stale_locked(self, group: Group) -> bool:
        return self.staleness.too_stale(group.min_version, self._version)

    def _evict_stale_locked(self) -> None:
        keep: collections.deque[tuple[int, Group]] = collections.deque()
        for seq, group in self._buffer:
            if self._too_stale_locked(group):
                self.staleness.on_discard()
                self._rejected["stale"] += 1
                heapq.heappush(self._requeue, (seq, self._pending[seq]))
            else:
                keep.append((seq, group))
        self._buffer = keep

    def _finished_locked(self, version: int) -> None:
        """An episode submitted at ``version`` ended (any outcome): a waiting batch may be ready."""
        self._running_versions[version] -= 1
        if self._running_versions[version] <= 0:
            del self._running_versions[version]
        self._cond.notify_all()

    def _due_running_locked(self) -> int:
        """Groups still generating that must be in the next batch (submitted at <= V - η)."""
        return self.staleness.due(self._running_versions, self._version)

    def _take(self, n: int) -> list[Group]:
        """The ``n`` buffered groups submitted first (due groups are among them)."""
        ordered = sorted(self._buffer, key=lambda item: (item[1].submit_version, item[0]))
        self._buffer = collections.deque(ordered[n:])
        groups = []
        for seq, group in ordered[:n]:
            self._pending.pop(seq, None)
            self._lag_hist[self._version - group.min_version] += 1
            groups.append(group)
        self._consumed += n
        if self.max_ahead:
            self._poke()  # the buffer shrank: submitting may go on
        return groups

    def _timeout_message(self, num_groups: int, timeout: float | None) -> str:
        st = self.staleness
        msg = (f"get_batch: {len(self._buffer)} of {num_groups} groups ready after {timeout} s "
               f"({st.running} prompts running, version {self._version})")
        due = self._due_running_locked()
        if due:
            msg += (f"; {due} of them were submitted at version <= {self._version - st.max_staleness} and must "
                    f"be trained in this batch (staleness bound {st.max_staleness})")
        if not st.running and st.capacity(self._version) == 0 and not self._paused:
            msg += (f"; the staleness rule allows no more prompts at version {self._version} "
                    f"({st.accepted} accepted of {st.limit(self._version)}): call set_version() after each "
                    "weight update")
        elif self._paused:
            msg += "; the controller is paused: call resume()"
        return msg

    def _pending_work(self) -> bool:
        return bool(self.staleness.running or self._requeue or self._delayed)

    def _poke(self) -> None:
        if self._loop is not None and self._wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    def _require_started(self, what: str) -> None:
        if not self._started:
            raise RuntimeError(f"RolloutController.{what}: call start() first")


# ====================================================================== module helpers


def client_kwargs(cfg: Config) -> dict[str, Any]:
    """InferenceClient options from ``cfg.generate``: the controller's client and rank 0's
    server-control client are made alike."""
    g = cfg.generate
    return {"request_timeout": g.request_timeout, "timeout_slack": g.timeout_slack, "dialect": dialect_for(g.backend),
            "per_server": connections_per_server(g), "control_timeout": g.control_timeout_s,
            "routed_experts": cfg.algo.routing_replay}


def connections_per_server(gen: GenerateConfig) -> int:
    """Requests a server may have in flight from the rollouts: twice its decode slots
    (``generate.max_running_requests``; the second half waits in the server's own queue,
    so a finishing request's slot is refilled without a round trip). 0 when the server
    sets its own limit (SGLang, vLLM without the knob): no cap here, the staleness rule's
    capacity bounds the total."""
    return 2 * gen.max_running_requests if gen.max_running_requests > 0 else 0


def client_factory(cfg: Config, urls: Sequence[str]) -> Callable[[], InferenceClient]:
    """Makes (unstarted) InferenceClients for ``urls`` set up by ``cfg``."""
    return _client_factory(urls, client_kwargs(cfg))


async def _await(fn: Callable[[InferenceClient], Any], client: InferenceClient) -> Any:
    return await fn(client)


def _client_factory(client: Callable[[], InferenceClient] | Sequence[str],
                    kwargs: dict[str, Any]) -> Callable[[], InferenceClient]:
    if callable(client):
        return client
    urls = [client] if isinstance(client, str) else list(client)
    if not urls:
        raise ValueError("RolloutController: no server URLs")

    def make() -> InferenceClient:
        return InferenceClient(urls, **kwargs)

    return make


def _uid_index(dataset: Any, uids: list[str]) -> dict[str, PromptSample]:
    """Samples by uid, for re-issuing pending samples on resume."""
    samples = getattr(dataset, "samples", None)
    if samples is None:
        raise TypeError(f"{type(dataset).__name__} has no 'samples'; the controller needs it to find the "
                        "pending samples of a checkpoint again")
    index = {s.uid: s for s in samples}
    missing = [u for u in uids if u not in index]
    if missing:
        raise ValueError(f"checkpoint's pending samples {missing[:5]} are not in this dataset "
                         f"({len(missing)} missing); is it the same data source?")
    return index
