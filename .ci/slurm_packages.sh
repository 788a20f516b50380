#!/usr/bin/env bash
# SLURM and munge (Debian/Ubuntu, as root) for tests/train/test_slurm_job.py, which starts its own
# slurmctld, two slurmd (one per network namespace) and munged; nothing here starts a daemon.
set -euo pipefail
for tool in slurmctld slurmd sbatch munged mungekey ip nsenter unshare; do
    command -v "$tool" >/dev/null || missing=1
done
[ -z "${missing:-}" ] && exit 0
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge iproute2 util-linux >/dev/null
