"""``realscale rank``: one process of a launched run, started by srun, torchrun or mpirun.

    srun  realscale rank --spec runs/x/launch/spec.json            # Slurm job step
    torchrun --nproc-per-node 2 -m realscale rank --spec ...        # no Slurm
    mpirun -np 2 python -m realscale rank --spec ...                # Open MPI / MPICH
    srun  realscale rank --spec ... --server                        # generation server i = task id

The launcher writes the spec (config, model dir, server URLs, run dir); the rank derives
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from its launcher's variables.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", required=True, help="the run spec, <run dir>/launch/spec.json")
    parser.add_argument("--server", action="store_true", help="be a generation server, not a trainer rank")
    parser.add_argument("--index", type=int, default=None, help="server index (default: SLURM_PROCID)")


def run(args: argparse.Namespace) -> int:
    from realscale.cli import UsageError
    from realscale.launcher.dist_env import DistEnvError
    from realscale.launcher.roles import generation_server, trainer_rank

    try:
        if args.server:
            return generation_server(args.spec, args.index)
        from realscale.trainer import rank_main

        return trainer_rank(args.spec, rank_main)
    except (FileNotFoundError, DistEnvError) as exc:
        raise UsageError(str(exc)) from None
