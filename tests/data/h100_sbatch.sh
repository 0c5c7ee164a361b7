#!/bin/bash

# Parameters
#SBATCH --account=my-team
#SBATCH --constraint=h100
#SBATCH --cpus-per-task=12
#SBATCH --error=<results>/jobs/submitit/%j_0_log.err
#SBATCH --exclusive
#SBATCH --gpus-per-node=8
#SBATCH --job-name=fsdp-bench-w16
#SBATCH --mail-type=FAIL
#SBATCH --mem=0
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --open-mode=append
#SBATCH --output=<results>/jobs/submitit/%j_0_log.out
#SBATCH --partition=gpu
#SBATCH --qos=normal
#SBATCH --requeue
#SBATCH --reservation=big-run
#SBATCH --signal=USR2@90
#SBATCH --time=120
#SBATCH --wckey=submitit

# setup
module load cuda/12.4 nccl
export NCCL_DEBUG=WARN

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output <results>/jobs/submitit/%j_%t_log.out --error <results>/jobs/submitit/%j_%t_log.err --cpu-bind=cores <python> -u -m submitit.core._submit <results>/jobs/submitit
