#!/usr/bin/env bash
# A real slow-link test bed: Linux network namespaces as "nodes", joined by veth pairs through a
# bridge that lives in its own namespace (the root namespace's networking is never touched), one
# node's link optionally throttled with tc's token bucket filter (netem is not available here).
#
#   scripts/netbed.sh up N_NODES [--throttle NODE RATE]   build N nodes (tears down an old bed first)
#   scripts/netbed.sh throttle NODE RATE                  throttle node NODE's link, both directions
#   scripts/netbed.sh unthrottle NODE                     remove the throttle
#   scripts/netbed.sh down                                remove everything of the bed
#   scripts/netbed.sh status                              namespaces, addresses, qdiscs
#
# Layout (PREFIX defaults to "rlbed", set NETBED_PREFIX to run several beds side by side):
#   namespace PREFIX-br : bridge br0, one port vbK per node
#   namespace PREFIX-nK : interface veth0 = 10.77.0.(K+1)/24 (NETBED_SUBNET, default 10.77.0),
#                         lo up (ranks of one node talk over lo, unthrottled)
# The subnet exists only inside the bed's namespaces. RATE is a tc rate (e.g. 30mbit). Needs root
# and iproute2 (ip netns, tc). Exit codes: 0 ok, 1 failure (the bed is removed), 2 bad usage,
# 3 not root or no `ip netns` (callers skip on 3).
set -euo pipefail

PREFIX="${NETBED_PREFIX:-rlbed}"
SUBNET="${NETBED_SUBNET:-10.77.0}"
BRNS="${PREFIX}-br"

die() { echo "netbed: $*" >&2; exit 1; }
usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

check_env() {
  if [[ "$(id -u)" != 0 ]]; then echo "netbed: needs root (uid $(id -u))" >&2; exit 3; fi
  if ! command -v ip >/dev/null || ! ip netns list >/dev/null 2>&1; then
    echo "netbed: 'ip netns' is not available (install iproute2)" >&2; exit 3
  fi
  if ! command -v tc >/dev/null; then echo "netbed: 'tc' is not available (install iproute2)" >&2; exit 3; fi
}

node_ns() { echo "${PREFIX}-n$1"; }

bed_namespaces() { ip netns list | awk '{print $1}' | grep -E "^${PREFIX}-(br|n[0-9]+)$" || true; }

down() {
  local ns
  for ns in $(bed_namespaces); do ip netns del "$ns" 2>/dev/null || true; done
  # a namespace can linger for a moment while its interfaces go away
  for _ in 1 2 3 4 5 6 7 8 9 10; do [[ -z "$(bed_namespaces)" ]] && return 0; sleep 0.1; done
  [[ -z "$(bed_namespaces)" ]] || die "could not remove namespaces: $(bed_namespaces | tr '\n' ' ')"
}

throttle() {  # NODE RATE: shape both directions of node NODE's link
  local k="$1" rate="$2" ns
  ns="$(node_ns "$k")"
  ip netns list | grep -qE "^${ns}( |$)" || die "no node $k (namespace $ns); run 'up' first"
  # burst: a few ms worth of tokens, at least one GSO segment; limit via latency (queue 100 ms)
  ip netns exec "$ns" tc qdisc replace dev veth0 root tbf rate "$rate" burst 64kb latency 100ms
  ip netns exec "$BRNS" tc qdisc replace dev "vb$k" root tbf rate "$rate" burst 64kb latency 100ms
}

unthrottle() {
  local k="$1"
  ip netns exec "$(node_ns "$k")" tc qdisc del dev veth0 root 2>/dev/null || true
  ip netns exec "$BRNS" tc qdisc del dev "vb$k" root 2>/dev/null || true
}

up() {
  local n="$1"; shift
  local t_node="" t_rate=""
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --throttle) [[ $# -ge 3 ]] || usage; t_node="$2"; t_rate="$3"; shift 3 ;;
      *) usage ;;
    esac
  done
  [[ "$n" =~ ^[0-9]+$ ]] && (( n >= 1 && n <= 200 )) || { echo "netbed: N_NODES=$n must be 1..200" >&2; exit 2; }
  if [[ -n "$t_node" ]] && ! { [[ "$t_node" =~ ^[0-9]+$ ]] && (( t_node < n )); }; then
    echo "netbed: throttled node $t_node must be 0..$((n - 1))" >&2; exit 2
  fi
  down
  # any failure from here on (a command, or die in a helper) removes the half-built bed
  trap 'rc=$?; if (( rc != 0 )); then echo "netbed: setup failed; removing the bed" >&2; down; fi' EXIT
  ip netns add "$BRNS"
  ip netns exec "$BRNS" ip link set lo up
  ip netns exec "$BRNS" ip link add br0 type bridge
  ip netns exec "$BRNS" ip link set br0 up
  local k ns
  for ((k = 0; k < n; k++)); do
    ns="$(node_ns "$k")"
    ip netns add "$ns"
    ip link add "vb$k" netns "$BRNS" type veth peer name veth0 netns "$ns"
    ip netns exec "$BRNS" ip link set "vb$k" master br0
    ip netns exec "$BRNS" ip link set "vb$k" up
    ip netns exec "$ns" ip link set lo up
    ip netns exec "$ns" ip addr add "${SUBNET}.$((k + 1))/24" dev veth0
    ip netns exec "$ns" ip link set veth0 up
  done
  if [[ -n "$t_node" ]]; then throttle "$t_node" "$t_rate"; fi
  # wait until every node reaches node 0 (ARP may take a moment); without ping, callers check TCP
  if command -v ping >/dev/null; then
    for ((k = 1; k < n; k++)); do
      ip netns exec "$(node_ns "$k")" ping -c 1 -W 2 "${SUBNET}.1" >/dev/null 2>&1 \
        || echo "netbed: warning: node $k does not answer ping to ${SUBNET}.1" >&2
    done
  fi
  trap - EXIT
  echo "netbed: up: $n nodes ${SUBNET}.1..${SUBNET}.$n, bridge in $BRNS${t_node:+, node $t_node throttled to $t_rate}"
}

status() {
  local ns
  if [[ -z "$(bed_namespaces)" ]]; then echo "netbed: down (prefix $PREFIX)"; return 0; fi
  for ns in $(bed_namespaces); do
    echo "== $ns"
    ip netns exec "$ns" ip -brief addr show 2>/dev/null | grep -v '^lo ' || true
    ip netns exec "$ns" tc qdisc show 2>/dev/null | grep -E 'tbf|htb' || true
  done
}

cmd="${1:-}"
[[ -n "$cmd" ]] || usage
shift
case "$cmd" in
  up) [[ $# -ge 1 ]] || usage; check_env; up "$@" ;;
  down) check_env; down; echo "netbed: down" ;;
  status) check_env; status ;;
  throttle) [[ $# -eq 2 ]] || usage; check_env; throttle "$1" "$2"; echo "netbed: node $1 throttled to $2" ;;
  unthrottle) [[ $# -eq 1 ]] || usage; check_env; unthrottle "$1"; echo "netbed: node $1 unthrottled" ;;
  -h|--help|help) usage ;;
  *) usage ;;
esac
