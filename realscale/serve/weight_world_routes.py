"""The embedded server's side of the reshard transport (realscale routes, not SGLang's).

- ``POST /realscale/join_weight_world`` ``{"world": WorldSpec, "rank_offset": int,
  "check_only": bool}``: every rank of this server joins the weight world at
  ``rank_offset + tp_rank`` and builds the same resharding plan as the trainer (from the
  rank's own model spec; its digest must match the trainer's). Answers once all ranks
  have joined, i.e. once the whole world has. ``check_only``: validate the world (model
  spec, backend, this server's ranks) and answer at once, joining nothing — the trainer
  asks this first, so a mismatch is a one-line error, not a hang. Joining again leaves
  the previous world (a rebuilt world after a server died).
- ``POST /realscale/update_weights_reshard`` ``{"name": world name, "weight_version":
  str}``: every rank receives its shard of the new weights into its weight buffer while
  the trainer ranks send; the version moves only once every rank has all its bytes.
  Answers ``{"success": true, "recv_bytes": [per rank], "weight_version": ...}``.
- ``POST /realscale/leave_weight_world``: drop the world.

Every route runs the rank functions below (:func:`check_rank`, :func:`join_rank`,
:func:`receive_rank`, :func:`leave_rank`) on every rank of the server, between forward
passes, through the server's collective RPC (``server.ranks.call_all("module:function",
...)``, which calls ``function(worker, ...)`` on each rank; a 1-rank server runs the same
code in its own process). So every rank of a ``--tp N`` server is a member of the weight
world in its own right: its shard arrives straight from the trainer ranks that hold the
slices, not through the server's rank 0. A rank's weights are one flat buffer in
``shard_index`` order (``worker.weights.flat``): exactly the resharder's destination
buffer, so the new weights land in place, with no conversion. A server whose dtype
differs from the trainer's receives the trainer's dtype and casts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from aiohttp import web

from realscale.parallel.mesh import LayoutError
from realscale.publish.weight_world import WorldMember, WorldSpec, plan_for
from realscale.serve import protocol as P

if TYPE_CHECKING:
    from realscale.parallel.model_spec import ModelSpec
    from realscale.publish.weight_world import WorldSpec
    from realscale.serve.ranks import RankWorker
    from realscale.serve.server import EmbeddedServer

KEY = "weight_world"  # where a rank keeps its WorldMember (worker.extras)


def _log(line: str) -> None:
    print(f"realscale serve: {line}", flush=True)


def check_world(world: "WorldSpec", rank_offset: int, ranks: int, spec: "ModelSpec", device_type: str) -> None:
    """Raise ValueError saying why a server of ``ranks`` ranks cannot join ``world``."""

    if world.backend == "nccl" and device_type != "cuda":
        raise ValueError(f"the weight world uses nccl but this server runs on {device_type}")
    offsets = [world.server_offset(i) for i in range(len(world.servers))]
    if rank_offset not in offsets:
        raise ValueError(f"rank_offset {rank_offset} is not a server's first rank in this world ({offsets})")
    mine = world.servers[offsets.index(rank_offset)]
    if mine != ranks:
        raise ValueError(f"the world gives this server {mine} ranks, it has {ranks}")
    plan_for(world, spec)  # raises on a model spec that differs from the trainer's


# ----------------------------------------------------------------------------- on every rank


def check_rank(worker: "RankWorker", world_json: dict, rank_offset: int) -> None:
    check_world(WorldSpec.from_json(world_json), rank_offset, worker.tp, worker.weights.spec, worker.device.type)


def join_rank(worker: "RankWorker", world_json: dict, rank_offset: int) -> int:
    """Leave any previous world, join this one at ``rank_offset + tp_rank``; returns that rank."""

    leave_rank(worker)
    member = WorldMember(WorldSpec.from_json(world_json), rank_offset + worker.tp_rank, worker.weights.spec)
    worker.extras[KEY] = member
    return member.rank


def receive_rank(worker: "RankWorker", name: str) -> int:
    """Receive this rank's shard of the new weights into its flat buffer; returns bytes."""

    member = worker.extras.get(KEY)
    if member is None or member.world.name != name:
        raise ValueError(f"not a member of weight world {name!r} (joined: {member.world.name if member else 'none'})")
    flat = worker.weights.flat
    if flat.dtype == member.dtype and flat.device == member.resharder.device:
        return member.receive(flat).recv_bytes
    tmp = torch.empty(flat.numel(), dtype=member.dtype, device=member.resharder.device)
    recv = member.receive(tmp).recv_bytes
    flat.copy_(tmp)
    return recv


def leave_rank(worker: "RankWorker") -> None:
    member = worker.extras.pop(KEY, None)
    if member is not None:
        member.close()


# ----------------------------------------------------------------------------- routes


def register(app: web.Application, server: "EmbeddedServer") -> None:
    """Add the routes above to the server's application."""
    routes = WeightWorldRoutes(server)
    app.router.add_post("/realscale/join_weight_world", routes.join)
    app.router.add_post("/realscale/update_weights_reshard", routes.update)
    app.router.add_post("/realscale/leave_weight_world", routes.leave)


class WeightWorldRoutes:
    def __init__(self, server: "EmbeddedServer") -> None:
        self.server = server

    async def _on_all_ranks(self, fn: str, *args: Any, version: str | None = None) -> list[Any]:
        """``fn(worker, *args)`` on every rank between forward passes; then tag ``version``."""
        return await self.server._on_all_ranks(f"{__name__}:{fn}", *args, version=version)

    async def join(self, request: web.Request) -> web.Response:
        what = "join_weight_world"
        body = P.check_object(await P.read_json(request), {"world", "rank_offset", "check_only"}, what)
        offset = P.require(body, "rank_offset", (int,), what)
        world = P.require(body, "world", (dict,), what)
        check_only = P.optional(body, "check_only", (bool,), what, False)
        try:
            await self._on_all_ranks("check_rank", world, offset)
            joined = [] if check_only else await self._on_all_ranks("join_rank", world, offset)
        except (LayoutError, ValueError, RuntimeError) as exc:
            return P.failure(f"{what}: {exc}")
        return web.json_response({"success": True, "ranks": joined})

    async def update(self, request: web.Request) -> web.Response:
        what = "update_weights_reshard"
        body = P.check_object(await P.read_json(request), {"name", "weight_version"}, what)
        name = P.require(body, "name", (str,), what)
        version = P.optional(body, "weight_version", (str, int), what)
        # one line each side of the receive: an operator (and the Slurm mid-update fault
        # test) can tell from the server's log whether it died holding half an update
        _log(f"receiving weights version {version} from world {name}")
        try:
            recv = await self._on_all_ranks("receive_rank", name, version=None if version is None else str(version))
        except (ValueError, KeyError, RuntimeError) as exc:
            _log(f"weights version {version} not received: {exc}")
            return P.failure(f"{what}: {exc}")
        _log(f"received weights version {version}: {sum(recv)} bytes")
        return web.json_response({"success": True, "recv_bytes": recv,
                                  "weight_version": self.server.engine.weight_version})

    async def leave(self, request: web.Request) -> web.Response:
        try:
            await self._on_all_ranks("leave_rank")
        except RuntimeError as exc:
            return P.failure(f"leave_weight_world: {exc}")
        return web.json_response({"success": True})
