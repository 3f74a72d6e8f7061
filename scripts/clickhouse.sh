#!/usr/bin/env bash
# Start/stop a throw-away ClickHouse server (Debian's clickhouse-server) on loopback for the tests.
# Usage: scripts/clickhouse.sh start|stop [DIR]   (DIR defaults to /tmp/ranklens-clickhouse)
# Ports: native 127.0.0.1:${RANKLENS_CH_TCP_PORT:-9000}, http ${RANKLENS_CH_HTTP_PORT:-8123}.
# RANKLENS_CH_QUERY_LOG=1: log every query in system.query_log (its memory_usage: what benchmarks read).
set -euo pipefail
cmd=${1:?usage: $0 start|stop [DIR]}
dir=${2:-/tmp/ranklens-clickhouse}
tcp=${RANKLENS_CH_TCP_PORT:-9000}
http=${RANKLENS_CH_HTTP_PORT:-8123}
qlog=""; logq=""
if [ "${RANKLENS_CH_QUERY_LOG:-0}" = 1 ]; then
  qlog="<query_log><database>system</database><table>query_log</table><flush_interval_milliseconds>1000</flush_interval_milliseconds></query_log>"
  logq="<log_queries>1</log_queries>"
fi
case "$cmd" in
start)
  command -v clickhouse-server >/dev/null || { echo "clickhouse-server is not installed (apt-get install clickhouse-server)" >&2; exit 2; }
  mkdir -p "$dir/data" "$dir/tmp" "$dir/user_files" "$dir/log"
  cat >"$dir/config.xml" <<XML
<?xml version="1.0"?>
<yandex>
  <logger><level>warning</level><log>$dir/log/server.log</log><errorlog>$dir/log/error.log</errorlog><console>0</console></logger>
  <listen_host>127.0.0.1</listen_host>
  <tcp_port>$tcp</tcp_port>
  <http_port>$http</http_port>
  <path>$dir/data/</path>
  <tmp_path>$dir/tmp/</tmp_path>
  <user_files_path>$dir/user_files/</user_files_path>
  <users_config>$dir/users.xml</users_config>
  <default_profile>default</default_profile>
  <default_database>default</default_database>
  <mark_cache_size>268435456</mark_cache_size>
  <max_concurrent_queries>100</max_concurrent_queries>
  $qlog
  <!-- a one-shard "cluster" of this server: Distributed tables in the tests (no ZooKeeper needed) -->
  <remote_servers><ranklens_self><shard><replica><host>127.0.0.1</host><port>$tcp</port></replica></shard></ranklens_self></remote_servers>
</yandex>
XML
  cat >"$dir/users.xml" <<XML
<?xml version="1.0"?>
<yandex>
  <profiles><default><max_memory_usage>4000000000</max_memory_usage>$logq</default></profiles>
  <users><default><password></password><networks><ip>127.0.0.1</ip><ip>::1</ip></networks><profile>default</profile><quota>default</quota></default></users>
  <quotas><default><interval><duration>3600</duration><queries>0</queries><errors>0</errors><result_rows>0</result_rows><read_rows>0</read_rows><execution_time>0</execution_time></interval></default></quotas>
</yandex>
XML
  if [ -f "$dir/pid" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null; then echo "clickhouse-server already running (pid $(cat "$dir/pid"))"; exit 0; fi
  nohup clickhouse-server --config-file="$dir/config.xml" >"$dir/log/stdout.log" 2>&1 &
  echo $! >"$dir/pid"
  for _ in $(seq 1 60); do
    if clickhouse-client --host 127.0.0.1 --port "$tcp" --query "SELECT version()" >/dev/null 2>&1; then
      echo "clickhouse-server $(clickhouse-client --host 127.0.0.1 --port "$tcp" --query 'SELECT version()') up on 127.0.0.1:$tcp (pid $(cat "$dir/pid"))"; exit 0
    fi
    sleep 0.5
  done
  echo "clickhouse-server did not come up; log:" >&2; tail -n 30 "$dir/log/stdout.log" "$dir/log/error.log" >&2 2>/dev/null || true; exit 1
  ;;
stop)
  if [ -f "$dir/pid" ]; then kill "$(cat "$dir/pid")" 2>/dev/null || true; for _ in $(seq 1 40); do kill -0 "$(cat "$dir/pid")" 2>/dev/null || break; sleep 0.25; done; kill -9 "$(cat "$dir/pid")" 2>/dev/null || true; rm -f "$dir/pid"; fi
  ;;
*) echo "usage: $0 start|stop [DIR]" >&2; exit 2;;
esac
