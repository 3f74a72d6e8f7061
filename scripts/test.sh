#!/usr/bin/env bash
# Runs the test suite. When Debian's clickhouse-server is installed and no server was named in
# RANKLENS_TEST_CLICKHOUSE, the first server test starts a throw-away server for the run on ports the
# OS picked free (tests/conftest.py), so the server-backend tests really execute and two runs never
# collide; without one they are skipped with the reason (RANKLENS_REQUIRE_SERVER=1 turns that into
# a failure, as in CI).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${RANKLENS_TEST_CLICKHOUSE:-}" ] && ! command -v clickhouse-server >/dev/null 2>&1; then
  echo "note: clickhouse-server is not installed: server-backend tests will be skipped (apt-get install clickhouse-server)" >&2
fi
.venv/bin/python -m pytest "$@"
