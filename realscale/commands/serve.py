"""``realscale serve``: start the embedded generation server (SGLang's HTTP protocol).

``--tp N`` runs it on N tensor-parallel ranks: this process (rank 0: HTTP + scheduler)
and N-1 worker processes it spawns (:mod:`realscale.serve.ranks`). Exit code 1 means
a rank died (the log says which)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-qwen2", help="HF model directory or built-in tiny model name")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=30000, help="TCP port")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--max-running", type=int, default=32, help="most requests decoded together (KV slots)")
    parser.add_argument("--context-length", type=int, default=2048, help="longest prompt + answer, in tokens")
    parser.add_argument("--weight-version", default="0", help="initial weight version tag")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes) of this server")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads per rank (0: torch's default for rank 0, 1 for the others)")


def run(args: argparse.Namespace) -> int:
    from realscale.cli import UsageError

    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    if args.max_running < 1 or args.context_length < 2:
        raise UsageError("--max-running must be >= 1 and --context-length >= 2")
    if args.tp < 1 or args.threads < 0:
        raise UsageError(f"--tp must be >= 1 and --threads >= 0, got --tp {args.tp} --threads {args.threads}")
    import torch

    from realscale.serve.server import EmbeddedServer, serve

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        server = EmbeddedServer(args.model, device=args.device, dtype=args.dtype, max_running=args.max_running,
                                context_length=args.context_length, weight_version=args.weight_version,
                                seed=args.seed, tp=args.tp, threads=max(1, args.threads))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(f"realscale serve: {server.model_path} on http://{args.host}:{args.port} ({args.tp} rank(s))", flush=True)
    return serve(server, args.host, args.port)
