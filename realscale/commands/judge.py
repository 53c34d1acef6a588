"""``realscale judge``: serve the code reward's sandbox to runs on other hosts.

Start it where the sandbox works (as root, or as a user where unprivileged user
namespaces are allowed); a code recipe then scores through it with
``reward.code_judge_url=http://HOST:PORT``. It takes the recipe's ``reward.*`` settings
(memory, disk, concurrency, interpreter, ``code_sandbox_allow_weaker``), so the judge and
the run agree on the limits. The protocol is :mod:`realscale.reward.judge`'s."""

from __future__ import annotations

import argparse

from realscale.commands import recipe_and_overrides


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", default=None, help="YAML recipe whose reward.* settings the judge uses")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. reward.code_concurrency=16")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8500, help="TCP port")


def run(args: argparse.Namespace) -> int:
    from realscale.cli import UsageError
    from realscale.config import load_config
    from realscale.reward.code_reward import CodeReward
    from realscale.reward.judge_service import JudgeService, serve_judge

    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    recipe, overrides = recipe_and_overrides(args)
    cfg = load_config(recipe, overrides).reward
    if cfg.code_judge_url:
        raise UsageError(f"reward.code_judge_url={cfg.code_judge_url}: a judge scores itself; leave it empty here")
    reward = CodeReward.from_config(cfg)
    ok, health = JudgeService(reward).status()
    if not ok:
        raise UsageError(f"the sandbox cannot run here: {health['reason']}")
    layers = "all layers" if health["full"] else f"WEAKER: missing {reward.isolation.describe()}"
    print(f"realscale judge: http://{args.host}:{args.port} (sandbox {health['mode']}, {layers})", flush=True)
    return serve_judge(reward, args.host, args.port)
