"""The embedded server's side of the reshard transport (realscale routes, not SGLang's).

- ``POST /realscale/join_weight_world`` ``{"world": WorldSpec, "rank_offset": int,
  "check_only": bool}``: every rank of this server joins the weight world at
  ``rank_offset + tp_rank`` and builds the same resharding plan as the trainer (from the
  server's own model config; the spec digest must match the trainer's). Answers once all
  ranks have joined, i.e. once the whole world has. ``check_only``: validate the world
  (model spec, backend, this server's ranks) and answer at once, joining nothing — the
  trainer asks this first, so a mismatch is a one-line error, not a hang. Joining again
  leaves the previous world (a rebuilt world after a server died).
- ``POST /realscale/update_weights_reshard`` ``{"name": world name, "weight_version":
  str}``: every rank receives its shard of the new weights into its weight buffer while
  the trainer ranks send; the version moves only once every rank has all its bytes.
  Answers ``{"success": true, "recv_bytes": [per rank], "weight_version": ...}``.
- ``POST /realscale/leave_weight_world``: drop the world.

A server rank's weights are one flat buffer in ``shard_index`` order (the resharder's
destination buffer). The embedded server of today has one rank and HF modules, so
:class:`SingleRankWorld` receives into such a buffer and copies the tensors into the
model (Megatron layout -> HF names through :mod:`realscale.models.convert`).
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


def server_spec(model_path: str, dtype: "torch.dtype") -> "ModelSpec":
    """The model spec a server plans with (its own config.json, its parameter dtype)."""
    import json
    import os

    from realscale.parallel.model_spec import spec_from_hf_config

    with open(os.path.join(model_path, "config.json"), encoding="utf-8") as fh:
        return spec_from_hf_config(json.load(fh), itemsize=dtype.itemsize)


def check_world(world: "WorldSpec", rank_offset: int, ranks: int, spec: "ModelSpec", device_type: str) -> None:
    """Raise ValueError saying why this server cannot join ``world``."""
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


class SingleRankWorld:
    """A one-rank server's membership: a flat buffer the resharder fills, then the
    tensors copied into the HF model by name."""

    def __init__(self, server: "EmbeddedServer") -> None:
        self.server = server
        self.member: Any = None
        self.buffer: Any = None

    @property
    def ranks(self) -> int:
        return 1

    def spec(self) -> "ModelSpec":
        param = next(self.server.engine.model.parameters())
        return server_spec(self.server.model_path, param.dtype)

    def join(self, world: "WorldSpec", rank_offset: int) -> None:
        import torch

        from realscale.parallel.weight_world import WorldMember, torch_dtype

        self.leave()
        self.member = WorldMember(world, rank_offset, self.spec())
        self.buffer = torch.empty(self.member.shard_numel(), dtype=torch_dtype(world.dtype),
                                  device=self.member.resharder.device)

    def receive(self, name: str) -> list[int]:
        if self.member is None or self.member.world.name != name:
            have = self.member.world.name if self.member else "none"
            raise ValueError(f"not a member of weight world {name!r} (joined: {have})")
        stats = self.member.receive(self.buffer)
        return [stats.recv_bytes]

    def hf_tensors(self) -> list[tuple[str, "torch.Tensor"]]:
        """The received shard (tp=1: full tensors) as HF-named tensors."""
        from realscale.models.family import load_arch

        return megatron_shard_to_hf(self.member.spec, self.member.resharder.dst_idx, self.buffer,
                                    load_arch(self.server.model_path))

    def leave(self) -> None:
        if self.member is not None:
            self.member.close()
        self.member, self.buffer = None, None


def _hf_names(name: str, arch: Any) -> tuple[Any, list[str]]:
    """The conversion rule of spec tensor ``name`` and the HF tensors it is made of."""
    from realscale.models.convert import match

    rule, layer = match(name)
    if rule.kind == "vocab" and arch.tie_embeddings:
        return rule, ["model.embed_tokens.weight"]
    return rule, [n.format(i=layer) for n in rule.hf]


def megatron_shard_to_hf(spec: "ModelSpec", idx: Any, buf: "torch.Tensor", arch: Any) -> list[tuple[str, Any]]:
    """Full (tp=1) Megatron-layout tensors of a flat buffer -> HF-named tensors."""
    from realscale.models.convert import megatron_to_hf
    from realscale.parallel.reshard_exec import unpack_shard

    out: list[tuple[str, Any]] = []
    for name, t in unpack_shard(spec, idx, buf).items():
        rule, names = _hf_names(name, arch)
        full = t.reshape(-1, *t.shape[2:]) if rule.kind in ("qkv", "fc1") else t
        out.extend(zip(names, megatron_to_hf(rule.kind, full, arch)))
    return out


def spec_full_from_hf(spec: "ModelSpec", hf: dict[str, "torch.Tensor"], arch: Any) -> dict[str, "torch.Tensor"]:
    """Full HF tensors -> the spec's full tensors (Megatron tp=1 layout, padded vocabulary):
    the inverse of :func:`megatron_shard_to_hf`."""
    from realscale.models.convert import hf_to_megatron

    out = {}
    for t in spec.tensors:
        rule, names = _hf_names(t.name, arch)
        padded = t.shape[0] if rule.kind == "vocab" else 0
        out[t.name] = hf_to_megatron(rule.kind, [hf[n] for n in names], arch, 0, 1, padded).reshape(t.shape)
    return out


def register(app: web.Application, server: "EmbeddedServer") -> None:
    """Add the routes above to the server's application."""
    routes = WeightWorldRoutes(server)
    app.router.add_post("/realscale/join_weight_world", routes.join)
    app.router.add_post("/realscale/update_weights_reshard", routes.update)
    app.router.add_post("/realscale/leave_weight_world", routes.leave)


class WeightWorldRoutes:
    def __init__(self, server: "EmbeddedServer") -> None:
        self.server = server
        self.world = SingleRankWorld(server)

    async def _blocking(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.server.pool, fn, *args)

    async def join(self, request: web.Request) -> web.Response:
        from realscale.parallel.mesh import LayoutError
        from realscale.parallel.weight_world import WorldSpec

        what = "join_weight_world"
        body = P.check_object(await _json(request), {"world", "rank_offset", "check_only"}, what)
        offset = P.require(body, "rank_offset", (int,), what)
        try:
            world = WorldSpec.from_json(P.require(body, "world", (dict,), what))
            check_world(world, offset, self.world.ranks, self.world.spec(), self.server.device.type)
            if not P.optional(body, "check_only", (bool,), what, False):
                await self._blocking(self.world.join, world, offset)
        except (LayoutError, ValueError, RuntimeError) as exc:
            return _failure(f"{what}: {exc}")
        return web.json_response({"success": True, "ranks": self.world.ranks})

    async def update(self, request: web.Request) -> web.Response:
        what = "update_weights_reshard"
        body = P.check_object(await _json(request), {"name", "weight_version"}, what)
        name = P.require(body, "name", (str,), what)
        version = P.optional(body, "weight_version", (str, int), what)
        engine = self.server.engine
        try:
            recv = await self._blocking(self.world.receive, name)
            named = self.world.hf_tensors()
            await asyncio.wrap_future(engine.call(lambda: engine.load_weights(
                named, None if version is None else str(version))))
        except (ValueError, KeyError, RuntimeError) as exc:
            return _failure(f"{what}: {exc}")
        return web.json_response({"success": True, "recv_bytes": recv, "weight_version": engine.weight_version})

    async def leave(self, request: web.Request) -> web.Response:
        self.world.leave()
        return web.json_response({"success": True})


async def _json(request: web.Request) -> Any:
    from realscale.generate.server import _body  # the server's one JSON-body reader

    return await _body(request)


def _failure(message: str) -> web.Response:
    from realscale.generate.server import _failure as failure

    return failure(message)
