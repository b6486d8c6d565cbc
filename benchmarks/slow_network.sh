#!/usr/bin/env bash
# Runs benchmarks/overlap.py over an emulated slow cluster link, where the exchange is bound by
# the network rather than by the CPU: two network namespaces joined by a veth pair, both ends
# rate-limited with tbf, one rank in each (env:// rendezvous, Gloo bound to the veth).
#
#   sudo benchmarks/slow_network.sh [--rate RATE] [overlap.py arguments...]
#
#   benchmarks/slow_network.sh                                  # 1gbit, default methods
#   benchmarks/slow_network.sh --rate 200mbit --steps 40
#   BURST=1mb LATENCY=20ms benchmarks/slow_network.sh --rate 10gbit --methods dense,topk
#
# RATE is a tc rate in [k|m|g]bit (default 1gbit). tbf's BURST defaults to 2 ms at RATE (at
# least 16 KB): 250 KB at 1gbit, 50 KB at 200mbit. Smaller buckets cost throughput at 1gbit on a
# busy machine (timer wake-ups); larger ones let each step's first burst of traffic go at veth
# speed, as the bucket refills while the ranks compute. LATENCY (default 10ms) is the longest a
# packet may queue before tbf drops it. Other arguments go to `python -m benchmarks.overlap` after
# `--network "veth, tbf RATE" --output overlap-RATE.md`, so they may override both. PYTHON
# names the interpreter as scripts/env.sh chooses it (default python3; where that is externally
# managed, the virtual environment scripts/setup.sh made). Needs root, ip and tc (iproute2); the
# namespaces (gs-rank0-PID, gs-rank1-PID, addresses 10.213.0.1/24 and 10.213.0.2/24) are deleted on exit,
# also on failure or Ctrl-C. Rank 0's table goes to stdout and to runs/benchmarks/ under the current
# directory; PYTHON and --output paths are taken relative to it, as overlap.py takes them.
set -euo pipefail

die() {
    echo "slow_network.sh: $*" >&2
    exit 1
}

rate=1gbit
args=()
while (($#)); do
    case $1 in
        --rate) (($# >= 2)) || die "--rate needs a value such as 1gbit or 200mbit"; rate=$2; shift 2 ;;
        --rate=*) rate=${1#--rate=}; shift ;;
        *) args+=("$1"); shift ;;
    esac
done

((EUID == 0)) || die "must run as root (network namespaces, veth, tc)"
for cmd in ip tc; do
    command -v "$cmd" >/dev/null || die "'$cmd' not found (install iproute2)"
done
if [[ -n ${BURST:-} ]]; then
    burst=$BURST
elif [[ ${rate,,} =~ ^([0-9]+)([kmg]?)bit$ ]]; then
    case ${BASH_REMATCH[2]} in k) scale=1000 ;; m) scale=1000000 ;; g) scale=1000000000 ;; *) scale=1 ;; esac
    burst=$((BASH_REMATCH[1] * scale / 4000)) # bytes in 2 ms
    burst=$((burst > 16000 ? burst : 16000))
else
    die "cannot size tbf's burst for rate '$rate': use [k|m|g]bit or set BURST"
fi
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The ranks run in the caller's directory with the repository on their path: a relative PYTHON,
# GRADSPARSE_VENV (scripts/env.sh: the interpreter scripts/setup.sh installed into) or --output
# means what it says there.
source "$repo/scripts/env.sh"
require_python slow_network.sh
python=$(command -v "$PYTHON")
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

ns=("gs-rank0-$$" "gs-rank1-$$")
veth=("gsv0-$$" "gsv1-$$")
addr=(10.213.0.1 10.213.0.2)
created=()
pids=()

cleanup() {
    local status=$?
    trap - EXIT INT TERM
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    wait 2>/dev/null || true
    for name in "${created[@]}"; do
        ip netns delete "$name" 2>/dev/null || echo "slow_network.sh: could not delete namespace $name" >&2
    done
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for i in 0 1; do
    ip netns add "${ns[i]}"
    created+=("${ns[i]}")
done
ip link add "${veth[0]}" netns "${ns[0]}" type veth peer name "${veth[1]}" netns "${ns[1]}"
for i in 0 1; do
    ip -n "${ns[i]}" link set lo up
    ip -n "${ns[i]}" addr add "${addr[i]}/24" dev "${veth[i]}"
    ip -n "${ns[i]}" link set "${veth[i]}" up
    tc -n "${ns[i]}" qdisc add dev "${veth[i]}" root tbf rate "$rate" burst "$burst" latency "${LATENCY:-10ms}"
done

for i in 0 1; do
    ip netns exec "${ns[i]}" env RANK="$i" LOCAL_RANK="$i" WORLD_SIZE=2 MASTER_ADDR="${addr[0]}" MASTER_PORT=29500 \
        GLOO_SOCKET_IFNAME="${veth[i]}" "$python" -m benchmarks.overlap \
        --network "veth, tbf $rate" --output "overlap-$rate.md" "${args[@]}" &
    pids+=($!)
done
# The first rank to fail ends the run (cleanup stops the other, which would wait for it).
for _ in 0 1; do
    wait -n || die "a rank failed (exit status $?)"
done
