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

Every route runs the rank functions below (:func:`join_rank`, :func:`receive_rank`,
:func:`leave_rank`) on every rank of the server, between forward passes, through the
server's collective RPC (``server.ranks.call_all("module:function", ...)``, which calls
``function(worker, ...)`` on each rank). A rank's weights are one flat buffer in
``shard_index`` order (``worker.weights.flat``): exactly the resharder's destination
buffer, so the new weights land in place, with no conversion. A server whose dtype differs
from the trainer's receives the trainer's dtype and casts.

A server without ranks (one process with HF modules) runs the same rank functions on a
:class:`_OneRank` stand-in whose flat buffer is copied into the model by HF name after
each receive.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from aiohttp import web

from realscale.generate import protocol as P

if TYPE_CHECKING:
    import torch

    from realscale.generate.server import EmbeddedServer
    from realscale.parallel.model_spec import ModelSpec
    from realscale.parallel.weight_world import WorldSpec

KEY = "weight_world"  # where a rank keeps its WorldMember (worker.extras)


def server_spec(model_path: str, dtype: "torch.dtype") -> "ModelSpec":
    """The model spec a server plans with (its own config.json, its parameter dtype)."""
    import json
    import os

    from realscale.parallel.model_spec import spec_from_hf_config

    with open(os.path.join(model_path, "config.json"), encoding="utf-8") as fh:
        return spec_from_hf_config(json.load(fh), itemsize=dtype.itemsize)


def check_world(world: "WorldSpec", rank_offset: int, ranks: int, spec: "ModelSpec", device_type: str) -> None:
    """Raise ValueError saying why a server of ``ranks`` ranks cannot join ``world``."""
    from realscale.parallel.weight_world import plan_for

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


def check_rank(worker: Any, world_json: dict, rank_offset: int) -> None:
    from realscale.parallel.weight_world import WorldSpec

    check_world(WorldSpec.from_json(world_json), rank_offset, worker.tp, worker.weights.spec, worker.device.type)


def join_rank(worker: Any, world_json: dict, rank_offset: int) -> int:
    """Leave any previous world, join this one at ``rank_offset + tp_rank``; returns that rank."""
    from realscale.parallel.weight_world import WorldMember, WorldSpec

    leave_rank(worker)
    member = WorldMember(WorldSpec.from_json(world_json), rank_offset + worker.tp_rank, worker.weights.spec)
    worker.extras[KEY] = member
    return member.rank


def receive_rank(worker: Any, name: str) -> int:
    """Receive this rank's shard of the new weights into its flat buffer; returns bytes."""
    import torch

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


def leave_rank(worker: Any) -> None:
    member = worker.extras.pop(KEY, None)
    if member is not None:
        member.close()


# ----------------------------------------------------------------------------- a server without ranks


class _Weights:
    def __init__(self, spec: "ModelSpec", flat: "torch.Tensor") -> None:
        from realscale.parallel.mesh import Layout, Mesh, Strategy
        from realscale.parallel.reshard import shard_index

        self.spec, self.flat = spec, flat
        self.layout = Layout(Mesh(0, 1), Strategy())
        self.index = shard_index(spec, self.layout, 0)


class _OneRank:
    """The rank functions' view of a one-process server with HF modules: a flat buffer
    (tp=1: full tensors) that :meth:`load_into_model` copies into the model by HF name."""

    tp, tp_rank = 1, 0

    def __init__(self, server: "EmbeddedServer") -> None:
        import torch

        from realscale.models.family import load_arch

        param = next(server.engine.model.parameters())
        spec = server_spec(server.model_path, param.dtype)
        self.server, self.device, self.extras = server, param.device, {}
        self.arch = load_arch(server.model_path)
        self.weights = _Weights(spec, torch.zeros(spec.n_params, dtype=param.dtype, device=param.device))

    def call_all(self, method: str, *args: Any) -> list[Any]:
        import importlib

        module, _, name = method.partition(":")
        return [getattr(importlib.import_module(module), name)(self, *args)]

    def load_into_model(self) -> None:
        from realscale.parallel.reshard_exec import unpack_shard

        named = megatron_full_to_hf(self.weights.spec, unpack_shard(self.weights.spec, self.weights.index,
                                                                    self.weights.flat), self.arch)
        self.server.engine.load_weights(named, None)


def _hf_names(name: str, arch: Any) -> tuple[Any, list[str]]:
    """The conversion rule of spec tensor ``name`` and the HF tensors it is made of."""
    from realscale.models.convert import match

    rule, layer = match(name)
    if rule.kind == "vocab" and arch.tie_embeddings:
        return rule, ["model.embed_tokens.weight"]
    return rule, [n.format(i=layer) for n in rule.hf]


def megatron_full_to_hf(spec: "ModelSpec", full: dict[str, "torch.Tensor"], arch: Any) -> list[tuple[str, Any]]:
    """The spec's full tensors (Megatron tp=1 layout) -> HF-named tensors."""
    from realscale.models.convert import megatron_to_hf

    out: list[tuple[str, Any]] = []
    for name, t in full.items():
        rule, names = _hf_names(name, arch)
        flat = t.reshape(-1, *t.shape[2:]) if rule.kind in ("qkv", "fc1") else t
        out.extend(zip(names, megatron_to_hf(rule.kind, flat, arch)))
    return out


def spec_full_from_hf(spec: "ModelSpec", hf: dict[str, "torch.Tensor"], arch: Any) -> dict[str, "torch.Tensor"]:
    """Full HF tensors -> the spec's full tensors (Megatron tp=1 layout, padded vocabulary):
    the inverse of :func:`megatron_full_to_hf`."""
    from realscale.models.convert import hf_to_megatron

    out = {}
    for t in spec.tensors:
        rule, names = _hf_names(t.name, arch)
        padded = t.shape[0] if rule.kind == "vocab" else 0
        out[t.name] = hf_to_megatron(rule.kind, [hf[n] for n in names], arch, 0, 1, padded).reshape(t.shape)
    return out


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
        self.one_rank: _OneRank | None = None

    def _ranks(self) -> Any:
        ranks = getattr(self.server, "ranks", None)
        if hasattr(ranks, "call_all"):  # a server with rank processes (collective RPC)
            return ranks
        if self.one_rank is None:
            self.one_rank = _OneRank(self.server)
        return self.one_rank

    async def _on_all_ranks(self, fn: str, *args: Any, version: str | None = None) -> list[Any]:
        """``fn(worker, *args)`` on every rank, between forward passes; then tag ``version``.
        (A server without ranks runs it off the scheduler thread and then loads the model.)"""
        engine, ranks = self.server.engine, self._ranks()
        target = f"{__name__}:{fn}"

        def tag() -> None:
            if isinstance(ranks, _OneRank) and fn == "receive_rank":
                ranks.load_into_model()
            if version is not None:
                engine.weight_version = version

        if isinstance(ranks, _OneRank):
            out = await asyncio.get_running_loop().run_in_executor(self.server.pool, ranks.call_all, target, *args)
            await asyncio.wrap_future(engine.call(tag))
            return out

        def run() -> list[Any]:
            out = ranks.call_all(target, *args)
            tag()
            return out

        return await asyncio.wrap_future(engine.call(run))

    async def join(self, request: web.Request) -> web.Response:
        from realscale.parallel.mesh import LayoutError

        what = "join_weight_world"
        body = P.check_object(await _json(request), {"world", "rank_offset", "check_only"}, what)
        offset = P.require(body, "rank_offset", (int,), what)
        world = P.require(body, "world", (dict,), what)
        check_only = P.optional(body, "check_only", (bool,), what, False)
        try:
            await self._on_all_ranks("check_rank", world, offset)
            joined = [] if check_only else await self._on_all_ranks("join_rank", world, offset)
        except (LayoutError, ValueError, RuntimeError) as exc:
            return _failure(f"{what}: {exc}")
        return web.json_response({"success": True, "ranks": joined})

    async def update(self, request: web.Request) -> web.Response:
        what = "update_weights_reshard"
        body = P.check_object(await _json(request), {"name", "weight_version"}, what)
        name = P.require(body, "name", (str,), what)
        version = P.optional(body, "weight_version", (str, int), what)
        try:
            recv = await self._on_all_ranks("receive_rank", name, version=None if version is None else str(version))
        except (ValueError, KeyError, RuntimeError) as exc:
            return _failure(f"{what}: {exc}")
        return web.json_response({"success": True, "recv_bytes": recv,
                                  "weight_version": self.server.engine.weight_version})

    async def leave(self, request: web.Request) -> web.Response:
        try:
            await self._on_all_ranks("leave_rank")
        except RuntimeError as exc:
            return _failure(f"leave_weight_world: {exc}")
        return web.json_response({"success": True})


async def _json(request: web.Request) -> Any:
    from realscale.generate.server import _body  # the server's one JSON-body reader

    return await _body(request)


def _failure(message: str) -> web.Response:
    from realscale.generate.server import _failure as failure

    return failure(message)
