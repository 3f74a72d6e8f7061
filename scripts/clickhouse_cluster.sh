#!/usr/bin/env bash
# A throw-away ClickHouse cluster on loopback: Debian's ZooKeeper (3.8) and four clickhouse-server
# (18.16) processes = cluster `ranklens`, 2 shards x 2 replicas (internal_replication: the
# ReplicatedMergeTree tables replicate, the Distributed tables write one replica per shard).
#
# Usage: scripts/clickhouse_cluster.sh start|stop|status [DIR]        (DIR: /tmp/ranklens-cluster)
#        scripts/clickhouse_cluster.sh start-node|stop-node|kill-node DIR N   (N: 1..4)
#
# Ports are picked free by the OS on the first start and kept in DIR/cluster.env (a restart reuses
# them), which `start` and `status` print:
#   ZK_PORT=...  CH1_TCP=... CH1_HTTP=... CH1_INTERSERVER=...  ... CH4_*   (node N: shard (N+1)/2,
#   replica 1 for odd N, 2 for even N; macros {shard}=0S, {replica}=rR).
# Readiness is polled: ZooKeeper answers `srvr`, every server answers a query and sees ZooKeeper.
# Then:  ranklens schema --target cluster | clickhouse-client --port $CH1_TCP -mn
#        ranklens ingest --store clickhouse://default@127.0.0.1:$CH1_TCP/ranklens ...
# Memory is kept modest (ZooKeeper -Xmx192m; per server a 64 MB mark cache, few background
# threads; 18.16 has no max_server_memory_usage: the per-query limit, 4 GB as scripts/clickhouse.sh).
set -euo pipefail
cmd=${1:?usage: $0 start|stop|status|start-node|stop-node|kill-node [DIR] [N]}
dir=${2:-/tmp/ranklens-cluster}
NODES="1 2 3 4"
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
envf="$dir/cluster.env"

die() { echo "clickhouse_cluster.sh: $*" >&2; exit 1; }

need_tools() {
  command -v clickhouse-server >/dev/null || die "clickhouse-server is not installed (apt-get install clickhouse-server clickhouse-client)"
  command -v java >/dev/null || die "java is not installed (ZooKeeper needs a JRE: apt-get install zookeeper)"
  [ -f /usr/share/java/zookeeper.jar ] || die "ZooKeeper is not installed (apt-get install zookeeper)"
}

pick_ports() {
  # 13 ports the OS picked free, all bound at once so no two are the same
  python3 - <<'PY' >"$envf.tmp"
import socket
socks = [socket.socket() for _ in range(13)]
for s in socks:
    s.bind(("127.0.0.1", 0))
ports = [s.getsockname()[1] for s in socks]
for s in socks:
    s.close()
print(f"ZK_PORT={ports[0]}")
for n in range(1, 5):
    tcp, http, inter = ports[3 * n - 2 : 3 * n + 1]
    print(f"CH{n}_TCP={tcp}\nCH{n}_HTTP={http}\nCH{n}_INTERSERVER={inter}")
PY
  mv "$envf.tmp" "$envf"
}

port() { local v="CH$1_$2"; echo "${!v}"; }

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

zk_ok() {  # ZooKeeper serves requests (the four-letter word `srvr`)
  local out
  out=$(timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$ZK_PORT; printf srvr >&3; cat <&3" 2>/dev/null) || return 1
  grep -q "^Mode: standalone" <<<"$out"
}

ch() { clickhouse-client --host 127.0.0.1 --port "$(port "$1" TCP)" --query "$2"; }

write_zk() {
  mkdir -p "$dir/zk/data" "$dir/zk/log"
  cat >"$dir/zk/zoo.cfg" <<CFG
tickTime=500
initLimit=10
syncLimit=5
dataDir=$dir/zk/data
clientPort=$ZK_PORT
clientPortAddress=127.0.0.1
maxClientCnxns=0
admin.enableServer=false
4lw.commands.whitelist=srvr,ruok
autopurge.purgeInterval=1
CFG
}

start_zk() {
  alive "$dir/zk/pid" && return 0
  write_zk
  # Debian's zkServer.sh would log to /var/log/zookeeper whatever we say (zkEnv.sh fixes it):
  # the same java command as its `start`, with this cluster's config, log and pid file
  nohup java -Xmx192m -Xss512k -XX:+UseSerialGC -Dzookeeper.log.dir="$dir/zk/log" \
    -cp /etc/zookeeper/conf:/usr/share/java/zookeeper.jar org.apache.zookeeper.server.quorum.QuorumPeerMain \
    "$dir/zk/zoo.cfg" >"$dir/zk/log/zookeeper.out" 2>&1 </dev/null &
  echo $! >"$dir/zk/pid"
  for _ in $(seq 1 240); do
    zk_ok && return 0
    alive "$dir/zk/pid" || break
    sleep 0.25
  done
  tail -n 30 "$dir"/zk/log/*.out "$dir"/zk/log/*.log >&2 2>/dev/null || true
  die "ZooKeeper did not answer on 127.0.0.1:$ZK_PORT"
}

write_node() {
  local n=$1 d="$dir/ch$n" shard=$(( ($1 + 1) / 2 )) replica=$(( ($1 + 1) % 2 + 1 ))
  mkdir -p "$d/data" "$d/tmp" "$d/user_files" "$d/log"
  local servers="" s r
  for s in 1 2; do
    servers+="<shard><internal_replication>true</internal_replication>"
    for r in 1 2; do servers+="<replica><host>127.0.0.1</host><port>$(port $(( 2 * s - 2 + r )) TCP)</port></replica>"; done
    servers+="</shard>"
  done
  cat >"$d/config.xml" <<XML
<?xml version="1.0"?>
<yandex>
  <logger><level>warning</level><log>$d/log/server.log</log><errorlog>$d/log/error.log</errorlog><console>0</console></logger>
  <listen_host>127.0.0.1</listen_host>
  <tcp_port>$(port "$n" TCP)</tcp_port>
  <http_port>$(port "$n" HTTP)</http_port>
  <interserver_http_port>$(port "$n" INTERSERVER)</interserver_http_port>
  <interserver_http_host>127.0.0.1</interserver_http_host>
  <path>$d/data/</path>
  <tmp_path>$d/tmp/</tmp_path>
  <user_files_path>$d/user_files/</user_files_path>
  <users_config>$d/users.xml</users_config>
  <default_profile>default</default_profile>
  <default_database>default</default_database>
  <mark_cache_size>67108864</mark_cache_size>
  <uncompressed_cache_size>67108864</uncompressed_cache_size>
  <max_concurrent_queries>100</max_concurrent_queries>
  <remote_servers><ranklens>$servers</ranklens></remote_servers>
  <zookeeper><node><host>127.0.0.1</host><port>$ZK_PORT</port></node><session_timeout_ms>6000</session_timeout_ms></zookeeper>
  <macros><shard>0$shard</shard><replica>r$replica</replica></macros>
  <distributed_ddl><path>/clickhouse/task_queue/ddl</path></distributed_ddl>
</yandex>
XML
  cat >"$d/users.xml" <<XML
<?xml version="1.0"?>
<yandex>
  <profiles><default>
    <max_memory_usage>4000000000</max_memory_usage>
    <background_pool_size>4</background_pool_size>
    <background_schedule_pool_size>8</background_schedule_pool_size>
    <max_threads>2</max_threads>
  </default></profiles>
  <users><default><password></password><networks><ip>127.0.0.1</ip><ip>::1</ip></networks><profile>default</profile><quota>default</quota></default></users>
  <quotas><default><interval><duration>3600</duration><queries>0</queries><errors>0</errors><result_rows>0</result_rows><read_rows>0</read_rows><execution_time>0</execution_time></interval></default></quotas>
</yandex>
XML
}

launch_node() {
  local n=$1 d="$dir/ch$1"
  alive "$d/pid" && return 0
  write_node "$n"
  nohup clickhouse-server --config-file="$d/config.xml" >"$d/log/stdout.log" 2>&1 &
  echo $! >"$d/pid"
}

wait_node() {  # answers a query and has a session with ZooKeeper
  local n=$1 d="$dir/ch$1"
  for _ in $(seq 1 480); do
    if ch "$n" "SELECT count() FROM system.zookeeper WHERE path = '/'" >/dev/null 2>&1; then return 0; fi
    alive "$d/pid" || break
    sleep 0.25
  done
  tail -n 30 "$d/log/stdout.log" "$d/log/error.log" >&2 2>/dev/null || true
  die "clickhouse-server node $n did not come up on 127.0.0.1:$(port "$n" TCP)"
}

stop_pid() {  # SIGTERM, wait up to 20 s, then SIGKILL
  local pidf=$1
  [ -f "$pidf" ] || return 0
  local pid; pid=$(cat "$pidf")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 80); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
  kill -9 "$pid" 2>/dev/null || true
  for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
  rm -f "$pidf"
}

print_status() {
  echo "ranklens cluster in $dir: 2 shards x 2 replicas, cluster 'ranklens'"
  echo "  zookeeper 127.0.0.1:$ZK_PORT $(alive "$dir/zk/pid" && echo "up (pid $(cat "$dir/zk/pid"))" || echo down)"
  local n
  for n in $NODES; do
    echo "  node $n shard $(( (n + 1) / 2 )) replica $(( (n + 1) % 2 + 1 )): tcp 127.0.0.1:$(port "$n" TCP) http $(port "$n" HTTP)" \
      "$(alive "$dir/ch$n/pid" && echo "up (pid $(cat "$dir/ch$n/pid"))" || echo down)"
  done
  echo "  store URL: clickhouse://default@127.0.0.1:$CH1_TCP/ranklens"
  sed 's/^/  /' "$envf"
}

node_arg() {
  local n=${1:?usage: $0 $cmd DIR N (N: 1..4)}
  case "$n" in 1|2|3|4) echo "$n";; *) die "node $n: N is 1..4";; esac
}

case "$cmd" in
start)
  need_tools
  [ -f "$envf" ] || pick_ports
  # shellcheck disable=SC1090
  . "$envf"
  start_zk
  for n in $NODES; do launch_node "$n"; done
  for n in $NODES; do wait_node "$n"; done
  print_status
  ;;
start-node)
  . "$envf"; n=$(node_arg "${3:-}"); launch_node "$n"; wait_node "$n"
  echo "node $n up on 127.0.0.1:$(port "$n" TCP) (pid $(cat "$dir/ch$n/pid"))"
  ;;
stop-node)
  . "$envf"; n=$(node_arg "${3:-}"); stop_pid "$dir/ch$n/pid"; echo "node $n stopped"
  ;;
kill-node)  # SIGKILL: no chance to finish anything in flight
  . "$envf"; n=$(node_arg "${3:-}")
  if [ -f "$dir/ch$n/pid" ]; then
    pid=$(cat "$dir/ch$n/pid"); kill -9 "$pid" 2>/dev/null || true
    for _ in $(seq 1 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    rm -f "$dir/ch$n/pid"
  fi
  echo "node $n killed"
  ;;
status)
  [ -f "$envf" ] || die "no cluster in $dir (start one with: $0 start $dir)"
  . "$envf"; print_status
  ;;
stop)
  [ -f "$envf" ] || exit 0
  . "$envf"
  for n in $NODES; do stop_pid "$dir/ch$n/pid" & done
  wait
  stop_pid "$dir/zk/pid"
  ;;
*) die "usage: $0 start|stop|status [DIR] | start-node|stop-node|kill-node DIR N";;
esac
