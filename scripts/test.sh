#!/usr/bin/env bash
# Runs the test suite. When Debian's clickhouse-server is installed and no server was named in
# RANKLENS_TEST_CLICKHOUSE, a throw-away server is started on 127.0.0.1:19000 for the run, so the
# server-backend tests really execute; without one they are skipped with the reason
# (RANKLENS_REQUIRE_SERVER=1 turns that into a failure, as in CI).
set -euo pipefail
cd "$(dirname "$0")/.."
started=""
if [ -z "${RANKLENS_TEST_CLICKHOUSE:-}" ] && command -v clickhouse-server >/dev/null 2>&1; then
  export RANKLENS_CH_TCP_PORT=${RANKLENS_CH_TCP_PORT:-19000} RANKLENS_CH_HTTP_PORT=${RANKLENS_CH_HTTP_PORT:-18123}
  dir=$(mktemp -d /tmp/ranklens-test-clickhouse.XXXXXX)
  scripts/clickhouse.sh start "$dir"
  started=$dir
  trap 'scripts/clickhouse.sh stop "$started"; rm -rf "$started"' EXIT
  export RANKLENS_TEST_CLICKHOUSE="clickhouse://default@127.0.0.1:$RANKLENS_CH_TCP_PORT"
elif [ -z "${RANKLENS_TEST_CLICKHOUSE:-}" ]; then
  echo "note: clickhouse-server is not installed: server-backend tests will be skipped (apt-get install clickhouse-server)" >&2
fi
.venv/bin/python -m pytest "$@"
