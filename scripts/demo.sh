#!/usr/bin/env bash
# Sets up (scripts/setup.sh demo) and runs the main job: a small CNN on Fashion-MNIST trained by
# 4 Gloo workers, first with plain DDP, then with Top-k at density 0.01, and a summary comparing
# the time each takes to reach the same accuracy. Where it can (root, network namespaces allowed),
# the 4 workers run on an emulated cluster of 4 hosts whose links go at 50 Mbit/s each way
# (benchmarks/cluster.py; docs/benchmarks.md says which real clusters that stands for), since
# on one machine's loopback the network is nearly free and the comparison would show only what
# selection costs:
#
#   python -m benchmarks.cluster --hosts 4 -- -m examples.cnn [ARGS...]       (root)
#   torchrun --standalone --nproc-per-node=4 -m examples.cnn [ARGS...]        (otherwise)
#
# with the interpreter setup.sh installed into (scripts/env.sh). ARGS go to examples.cnn
# (python -m examples.cnn --help). GRADSPARSE_DEMO_NETWORK=loopback forces the second form.
set -euo pipefail
# setup.sh and env.sh from the caller's directory: a relative PYTHON is a path from there
bash "$(dirname "$0")/setup.sh" demo
source "$(dirname "$0")/env.sh"
cd "$(dirname "$0")/.."
can_emulate() {
  [ "$(id -u)" = 0 ] && command -v ip > /dev/null && command -v tc > /dev/null || return 1
  local probe="gsc-probe-$$"
  ip netns add "$probe" 2> /dev/null || return 1
  # what the cluster does next: a veth pair and a rate-limited link (CAP_NET_ADMIN, sch_tbf)
  local status=0
  ip -n "$probe" link add eth0 type veth peer name eth1 2> /dev/null \
    && tc -n "$probe" qdisc add dev eth0 root tbf rate 50mbit burst 16000 latency 20ms 2> /dev/null || status=1
  ip netns delete "$probe"
  return $status
}
if [ "${GRADSPARSE_DEMO_NETWORK:-cluster}" != loopback ] && can_emulate; then
  exec "$PYTHON" -m benchmarks.cluster --hosts 4 --rate 50mbit -- -m examples.cnn "$@"
fi
if [ "${GRADSPARSE_DEMO_NETWORK:-cluster}" = loopback ]; then
  echo "demo: GRADSPARSE_DEMO_NETWORK=loopback: 4 workers on this machine's loopback"
else
  echo "demo: no emulated cluster here (it needs root and network namespaces): 4 workers on this machine's loopback"
fi
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node=4 -m examples.cnn "$@"
