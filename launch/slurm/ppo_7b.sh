#!/usr/bin/env bash
# ppo_7b: rendered by `realscale sweep` from configs/r1_distill_qwen_7b_math.yaml; change the recipe and re-render
# (python -m realscale sweep configs/sweeps/<sweep>.yaml --out launch/slurm) instead of
# editing this file. Extra `key=value` arguments to sbatch are passed on as overrides:
#   sbatch launch/slurm/ppo_7b.sh run.total_steps=10
#SBATCH --job-name=rs-ppo_7b
#SBATCH --nodes=24
#SBATCH --gpus-per-node=8
#SBATCH --ntasks-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --time=48:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@900
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"  # recipes and plans are paths relative to the repository
echo "realscale: job ${SLURM_JOB_ID:-?} restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST:-?}"
# exec: the launcher itself receives the USR1 above; it starts servers and ranks as
# job steps (srun), checkpoints on USR1 and requeues the job, which then resumes.
exec "${REALSCALE_PYTHON:-python}" -m realscale train configs/r1_distill_qwen_7b_math.yaml parallel.plan=launch/slurm/plans/ppo_7b.yaml "$@"
