"""``realscale rank``: one process of a launched run, started by srun, torchrun or mpirun.

    srun  realscale rank --spec runs/x/launch/spec.json            # Slurm job step
    torchrun --nproc-per-node 2 -m realscale rank --spec ...        # no Slurm
    mpirun -np 2 python -m realscale rank --spec ...                # Open MPI / MPICH
    srun  realscale rank --spec ... --server                        # generation server i = task id

The launcher writes the spec (config, model dir, server URLs, run dir, and what the ranks
run: the RL loop, or a stage of ``realscale sft`` from ``<dir>/launch/sft-spec.json``); the
rank derives RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from its
launcher's variables.
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
        from realscale.launcher.spec import entry_name
        from realscale.sft import sft_rank
        from realscale.trainer import rank_main

        return trainer_rank(args.spec, {entry_name(fn): fn for fn in (rank_main, sft_rank)})
    except (FileNotFoundError, DistEnvError) as exc:
        raise UsageError(str(exc)) from None
