#!/usr/bin/env bash
# SLURM integration test (CI): a one-node SLURM on this machine runs slurm/cpu.sbatch for real.
#
#   bash scripts/slurm_ci.sh          # as root: it installs packages and starts daemons
#
# 1. Installs slurm-wlm and munge with apt when missing (the packages may not start services
#    meanwhile: a policy-rc.d denying them is put in place for the install if none exists).
# 2. Writes a private slurm.conf for this host ($(hostname -s), CPUs from nproc, 1 GB of memory,
#    select/cons_tres, proctrack/linuxproc, task/none, no cgroups, no accounting, ports 16817
#    and 16818) in $GRADSPARSE_SLURM_DIR (default /tmp/gradsparse-slurm), with the daemons' state,
#    logs and pid files. /etc/slurm is left alone: every command finds the file through SLURM_CONF.
# 3. Creates the munge key if missing; starts munged unless one answers already, then slurmctld
#    (with a clean state, -c) and slurmd, as root; waits until sinfo shows the node idle.
# 4. Submits slurm/cpu.sbatch (sbatch --export=ALL: the job runs with this shell's PATH, PYTHONPATH
#    and PYTHON, the interpreter scripts/setup.sh installed into, as scripts/env.sh chooses it) for
#    a tiny run: 2 tasks, --preset demo --method dense,topk --max-steps 3, --out in the state folder;
#    waits for it (GRADSPARSE_SLURM_TIMEOUT seconds, default 600, then scancel), prints the job's
#    log and checks: state COMPLETED, exit code 0:0, 2 workers, and
#    for each method an epochs.csv whose rows all have a finite loss, the last at step 3. Then
#    the same for Top-k under sbatch --export=VENV=<venv> alone, as a site's --export=NONE leaves
#    a job: PYTHON's virtual environment (setup.sh's .venv), or one made over PYTHON's packages
#    (--system-site-packages).
# 5. Stops the daemons it started (munged only if it started it) and exits non-zero on any
#    failure. GRADSPARSE_SLURM_KEEP=1 leaves them running, to submit more jobs by hand after
#    `export SLURM_CONF=/tmp/gradsparse-slurm/slurm.conf`.
#
# Idempotent: packages already installed are not touched, the files are rewritten, daemons left by
# an earlier run (GRADSPARSE_SLURM_KEEP=1, or an interrupted run; found by their pid files) are
# stopped first, and the run folder starts empty.
set -euo pipefail
# The interpreter setup.sh installed into (from the caller's directory: a relative PYTHON is a path
# from there), exported to the job
source "$(dirname "$0")/env.sh"
cd "$(dirname "$0")/.."
repo="$(pwd)"
dir="${GRADSPARSE_SLURM_DIR:-/tmp/gradsparse-slurm}"
timeout="${GRADSPARSE_SLURM_TIMEOUT:-600}"
keep="${GRADSPARSE_SLURM_KEEP:-0}"
host="$(hostname -s)"
conf="$dir/slurm.conf"
steps=3
start=$SECONDS
if [ "$(id -u)" -ne 0 ]; then
  echo "$0: run as root (it installs packages and starts the SLURM daemons)" >&2
  exit 2
fi
say() { printf '[slurm_ci %3ds] %s\n' "$((SECONDS - start))" "$*"; }

# --- 1. packages ------------------------------------------------------------------------------
if ! dpkg -s slurm-wlm munge > /dev/null 2>&1; then
  say "installing slurm-wlm and munge"
  policy=/usr/sbin/policy-rc.d
  own_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod 755 "$policy"
    own_policy=1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge > /dev/null
  if [ "$own_policy" = 1 ]; then rm -f "$policy"; fi
fi

# --- daemons: stop (ours only, by pid file), cleanup on exit ----------------------------------
stop_pidfile() {  # stop_pidfile FILE NAME: the process of FILE if it is still NAME
  local file="$1" name="$2" pid
  [ -s "$file" ] || return 0
  pid="$(cat "$file")"
  if [ "$(cat "/proc/$pid/comm" 2> /dev/null)" = "$name" ]; then
    kill "$pid" 2> /dev/null || true
    for _ in $(seq 50); do
      [ -d "/proc/$pid" ] || break
      sleep 0.2
    done
    if [ -d "/proc/$pid" ]; then kill -9 "$pid" 2> /dev/null || true; fi
  fi
  rm -f "$file"
}
stop_slurm() {
  stop_pidfile "$dir/slurmd.pid" slurmd
  stop_pidfile "$dir/slurmctld.pid" slurmctld
}
munge_pidfile=/run/munge/munged.pid
started_munge_marker="$dir/munged.started-by-slurm_ci"
jobid=""
finish() {
  local rc=$?
  if [ -n "$jobid" ] && [ -n "$(squeue -h -j "$jobid" 2> /dev/null)" ]; then scancel "$jobid" || true; fi
  if [ "$keep" = 1 ]; then
    say "daemons left running (GRADSPARSE_SLURM_KEEP=1): export SLURM_CONF=$conf"
  else
    stop_slurm
    if [ -e "$started_munge_marker" ]; then
      stop_pidfile "$munge_pidfile" munged
      rm -f "$started_munge_marker"
    fi
    say "daemons stopped"
  fi
  if [ "$rc" -ne 0 ]; then say "FAILED (exit $rc)"; fi
  exit "$rc"
}
show_logs() {
  for f in "$dir/slurmctld.log" "$dir/slurmd.log"; do
    echo "--- tail $f"
    tail -n 30 "$f" 2> /dev/null || true
  done
}

stop_slurm  # left by an earlier run
mkdir -p "$dir/state" "$dir/spool"
rm -f "$dir"/job-*.log "$dir/jobcomp.log" "$dir/slurmctld.log" "$dir/slurmd.log"  # a fresh record per run
trap finish EXIT

# --- 2. slurm.conf ----------------------------------------------------------------------------
cpus="$(nproc)"
if [ "$cpus" -lt 2 ]; then cpus=2; fi  # 2 tasks; config_overrides lets the node claim them
cat > "$conf" << EOF
# Written by gradsparse scripts/slurm_ci.sh: a one-node SLURM for CI (no cgroups, no accounting).
ClusterName=gradsparse-ci
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/jobcomp.log
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=600
KillWait=5
InactiveLimit=0
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=1000 State=UNKNOWN
PartitionName=ci Nodes=$host Default=YES MaxTime=60 State=UP
EOF
export SLURM_CONF="$conf"

# --- 3. munge, slurmctld, slurmd --------------------------------------------------------------
munge_ok() { munge -n < /dev/null 2> /dev/null | unmunge > /dev/null 2>&1; }
if ! munge_ok; then
  key=/etc/munge/munge.key
  if [ ! -s "$key" ]; then
    say "creating $key"
    mkdir -p /etc/munge
    if command -v mungekey > /dev/null; then
      mungekey --create --keyfile="$key"
    else
      dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
    fi
    chown munge:munge "$key"
    chmod 400 "$key"
  fi
  mkdir -p /run/munge
  chown munge:munge /run/munge
  say "starting munged"
  runuser -u munge -- /usr/sbin/munged
  touch "$started_munge_marker"
  for _ in $(seq 50); do
    munge_ok && break
    sleep 0.2
  done
  munge_ok || { echo "munged does not answer" >&2; exit 1; }
fi
say "starting slurmctld and slurmd ($host, $cpus CPUs, config $conf)"
slurmctld -c
slurmd -c
state=""
for _ in $(seq 120); do
  state="$(sinfo -h -N -n "$host" -o %t 2> /dev/null || true)"
  [ "$state" = idle ] && break
  sleep 0.5
done
if [ "$state" != idle ]; then
  echo "node $host is not idle after 60 s (state '${state:-none}')" >&2
  show_logs
  exit 1
fi
sinfo

# --- 4. the jobs ------------------------------------------------------------------------------
# run_job LABEL EXPORT OUT METHODS: submits slurm/cpu.sbatch with sbatch --export=EXPORT for a
# run of METHODS (comma-separated) into OUT, waits for it and checks it; returns 1 on a failure.
run_job() {
  local label="$1" export="$2" out="$3" methods="$4" now last="" submitted info job_state exit_code fail=0
  rm -rf "$out"
  local args=(--preset demo --method "$methods" --max-steps "$steps" --out "$out" --no-progress)
  jobid="$(sbatch --parsable --export="$export" --job-name="gradsparse-ci-$label" --nodes=1 --ntasks=2 \
    --cpus-per-task=1 --time=00:15:00 --output="$dir/job-%j.log" slurm/cpu.sbatch "${args[@]}")"
  jobid="${jobid%%;*}"
  submitted=$SECONDS
  say "submitted job $jobid ($label, --export=$export): slurm/cpu.sbatch ${args[*]}"
  while :; do
    now="$(squeue -h -j "$jobid" -o %T 2> /dev/null || true)"
    [ -z "$now" ] && break
    if [ "$now" != "$last" ]; then say "job $jobid $now"; last="$now"; fi
    if ((SECONDS - submitted > timeout)); then
      echo "job $jobid still $now after ${timeout} s: cancelling" >&2
      scancel "$jobid" || true
      cat "$dir/job-$jobid.log" 2> /dev/null || true
      show_logs
      return 1
    fi
    sleep 1
  done
  info="$(scontrol show job "$jobid" 2> /dev/null || grep "JobId=$jobid " "$dir/jobcomp.log" || true)"
  job_state="$(grep -o 'JobState=[A-Z_]*' <<< "$info" | head -n 1 | cut -d= -f2 || true)"
  exit_code="$(grep -o ' ExitCode=[0-9:]*' <<< "$info" | head -n 1 | cut -d= -f2 || true)"
  say "job $jobid finished: state ${job_state:-unknown}, exit code ${exit_code:-unknown}"
  echo "--- job log $dir/job-$jobid.log"
  cat "$dir/job-$jobid.log" || true
  echo "---"
  if [ "$job_state" != COMPLETED ] || [ "$exit_code" != 0:0 ]; then
    echo "FAIL: job state ${job_state:-unknown}, exit code ${exit_code:-unknown} (want COMPLETED, 0:0)" >&2
    show_logs
    fail=1
  fi
  if ! grep -q ": 2 workers (gloo)" "$dir/job-$jobid.log" 2> /dev/null; then
    echo "FAIL: the log does not show 2 Gloo workers" >&2
    fail=1
  fi
  "$PYTHON" - "$out" "$steps" "$methods" << 'EOF' || fail=1
import csv, math, os, sys

out, steps, methods = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
bad = False
for method in methods:
    path = os.path.join(out, method if len(methods) > 1 else "", "epochs.csv")  # one method: --out itself
    if not os.path.isfile(path):
        print(f"FAIL: {path} is missing", file=sys.stderr)
        bad = True
        continue
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    losses = [float(row["loss"]) for row in rows]
    if not rows or not all(math.isfinite(x) for x in losses) or int(rows[-1]["step"]) != steps:
        print(f"FAIL: {path}: losses {losses}, last step {rows[-1]['step'] if rows else None} (want {steps})",
              file=sys.stderr)
        bad = True
    else:
        print(f"ok: {path}: {len(rows)} row(s), step {steps}, loss {losses[-1]:.4f}")
sys.exit(1 if bad else 0)
EOF
  if [ "$fail" -ne 0 ]; then return 1; fi
  say "PASS: slurm/cpu.sbatch ran under SLURM ($label: job $jobid; output in $out; repo $repo)"
}

run_job export-all ALL "$dir/run" dense,topk
# A site's --export=NONE (here with the one variable VENV): sbatch hands srun no environment through
# SLURM_EXPORT_ENV, and the job's tasks found no interpreter until the script's srun said
# --export=ALL. PYTHON's virtual environment (setup.sh's .venv), or one made over its packages.
venv="$("$PYTHON" -c 'import sys; print(sys.prefix if sys.prefix != sys.base_prefix else "")')"
if [ -z "$venv" ]; then
  venv="$dir/venv"
  rm -rf "$venv"
  "$PYTHON" -m venv --system-site-packages "$venv"
fi
if ! "$venv/bin/python" -c "import gradsparse" 2> /dev/null; then
  echo "FAIL: the virtual environment $venv (for PYTHON=$PYTHON) has no gradsparse" >&2
  exit 1
fi
run_job export-venv-only "VENV=$venv" "$dir/run-venv" topk
