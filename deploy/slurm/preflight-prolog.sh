#!/bin/bash
# Slurm Prolog: `ranklens preflight` on each node of a job before the job starts (slurm.conf:
# Prolog=/etc/slurm/prolog.d/ranklens-preflight.sh, PrologFlags=Alloc so that it runs on every
# allocated node at allocation rather than at each node's first step). slurmd runs it as root.
#
# It checks this node only (--checks host,storage,env,software,gpu: the cross-node net.* checks
# are train.sbatch's RANKLENS_PREFLIGHT=1 step) and logs the verdict to syslog
# (`journalctl -t ranklens-preflight`, or /var/log/syslog) and to stderr. Exit status:
#   ranklens exit 0 (pass) or 10 (warnings only)  -> 0: the job starts;
#   ranklens exit 11 (this node failed)           -> 1: Slurm drains the node (reason "Prolog
#     error"; `sinfo -R`) and requeues the job, held unless SchedulerParameters has
#     nohold_on_prolog_fail. The failed checks are in the log line, and in the store's
#     `preflight` table when a store is set. `scontrol update nodename=N state=resume` when fixed.
#   anything else: ranklens missing, a usage error (2), the store unavailable (4, after one retry
#     without the store), a crash, or past RANKLENS_PREFLIGHT_TIMEOUT -> 0, with a warning logged.
#     A broken health check must not drain a healthy cluster: one bad install or config, or a
#     store outage, would otherwise drain every node it runs on. RANKLENS_PREFLIGHT_STRICT=1
#     makes these exit 1 instead (drain).
#
# Settings: environment variables, else RANKLENS_* lines of $RANKLENS_ENV_FILE (default
# /etc/ranklens/collector.env, the collector's; KEY=value lines, read, not sourced):
#   RANKLENS_STORE, RANKLENS_STORE_PASSWORD  where the results go (--store); unset: not stored
#   RANKLENS_BIN                 the ranklens to run (default: `ranklens` on PATH). The training
#                                environment's, with torch: the collector's own (/opt/ranklens,
#                                no torch) fails software.torch on every node
#   RANKLENS_CHECKPOINT_PATH     the jobs' checkpoint directory (--checkpoint-path)
#   RANKLENS_PREFLIGHT_CHECKS    default host,storage,env,software,gpu
#   RANKLENS_PREFLIGHT_ARGS      more options, split on spaces (e.g. "--gpus 8 --mount /data")
#   RANKLENS_PREFLIGHT_TIMEOUT   seconds, default 120; keep it below Slurm's PrologEpilogTimeout
#   RANKLENS_PREFLIGHT_STRICT    1: a check that cannot run fails the node
#   RANKLENS_HOST                the node's name in the results (default: the host name, as
#                                the collector and the ranks name it)
# Tested by tests/app/test_deploy_preflight.py; see docs/preflight-deploy.md.
set -uo pipefail  # no -e: every exit status below is looked at

# slurmd gives prologs no search path
export PATH="${PATH:+$PATH:}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TAG=ranklens-preflight

say() {  # PRIORITY MESSAGE...: to syslog when logger is there, and to stderr
  local prio=$1
  shift
  printf '%s: %s\n' "$TAG" "$*" >&2
  if command -v logger >/dev/null 2>&1; then
    logger -t "$TAG" -p "user.$prio" -- "$*" 2>/dev/null || true
  fi
}

broken() {  # MESSAGE: the check could not run; the node is not judged unless strict
  if [ "${RANKLENS_PREFLIGHT_STRICT:-0}" = 1 ]; then
    say err "$1; RANKLENS_PREFLIGHT_STRICT=1: exit 1 (Slurm drains the node)"
    exit 1
  fi
  say warning "$1; the node is not judged, exit 0 (RANKLENS_PREFLIGHT_STRICT=1 would drain it)"
  exit 0
}

# KEY=value lines (the systemd EnvironmentFile syntax the collector's unit reads: comments,
# optional quotes); only RANKLENS_* names (this runs as root: no PATH or LD_* from a file), and a
# variable already in the environment wins
env_file=${RANKLENS_ENV_FILE:-/etc/ranklens/collector.env}
if [ -r "$env_file" ]; then
  while IFS= read -r line || [ -n "$line" ]; do
    line=${line#"${line%%[![:space:]]*}"}
    case $line in '' | '#'* | ';'*) continue ;; esac
    key=${line%%=*}
    val=${line#*=}
    [[ $key =~ ^RANKLENS_[A-Z0-9_]+$ && $line == *=* ]] || continue
    if [[ $val == \"*\" || $val == \'*\' ]]; then val=${val:1:${#val}-2}; fi
    [ -n "${!key+set}" ] || export "$key=$val"
  done < "$env_file"
elif [ -e "$env_file" ]; then
  say warning "cannot read $env_file (RANKLENS_ENV_FILE): going on without it"
fi

timeout_s=${RANKLENS_PREFLIGHT_TIMEOUT:-120}
[[ $timeout_s =~ ^[1-9][0-9]*$ ]] || broken "RANKLENS_PREFLIGHT_TIMEOUT=$timeout_s: expected whole seconds > 0 (default 120)"
bin=${RANKLENS_BIN:-$(command -v ranklens || true)}
if [ -z "$bin" ] || ! [ -x "$bin" ]; then
  broken "ranklens not found (RANKLENS_BIN=${RANKLENS_BIN:-unset}, PATH=$PATH)"
fi

args=(preflight --checks "${RANKLENS_PREFLIGHT_CHECKS:-host,storage,env,software,gpu}" --json)
[ -n "${RANKLENS_CHECKPOINT_PATH:-}" ] && args+=(--checkpoint-path "$RANKLENS_CHECKPOINT_PATH")
# the job id train.sbatch gives the ranks
[ -n "${SLURM_JOB_ID:-}" ] && args+=(--job-id "slurm-${SLURM_JOB_ID}${SLURM_RESTART_COUNT:+-r${SLURM_RESTART_COUNT}}")
if [ -n "${RANKLENS_PREFLIGHT_ARGS:-}" ]; then  # split on spaces, never globbed
  read -ra extra <<< "$RANKLENS_PREFLIGHT_ARGS"
  args+=("${extra[@]}")
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/ranklens-preflight.XXXXXX") || broken "cannot make a temporary directory"
trap 'rm -rf "$tmp"' EXIT

run() {  # [--store URL]: ranklens' exit status; its JSON in $tmp/out, its stderr in $tmp/err
  timeout -k 10 "$timeout_s" "$bin" "${args[@]}" "$@" > "$tmp/out" 2> "$tmp/err"
}

if [ -n "${RANKLENS_STORE:-}" ]; then
  run --store "$RANKLENS_STORE"
  rc=$?
  if [ "$rc" = 4 ]; then  # the store is down: still check the node, without it
    say warning "the store is unavailable (exit 4: $(tail -c 300 "$tmp/err" | tr '\n' ' ')); checking without it"
    (unset RANKLENS_STORE RANKLENS_STORE_PASSWORD; run)
    rc=$?
  fi
else
  run
  rc=$?
fi

# One line per node from the JSON report: verdict and reasons (ranklens' own Python reads it)
py="$(dirname "$bin")/python3"
[ -x "$py" ] || py=$(command -v python3 || true)
summary=
if [ -n "$py" ] && [ -s "$tmp/out" ]; then
  summary=$("$py" - "$tmp/out" 2>/dev/null <<'EOF'
import json, sys
doc = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
for n in doc["nodes"]:
    why = "; ".join(n.get("reasons") or [])
    print(f"node {n['node']}: verdict {n['verdict']}" + (f" ({why})" if why else ""), end=" ")
print(f"[{sum(doc['counts'].values())} results, run {doc.get('run_id', '')}]", end="")
EOF
  ) || summary=
fi
summary=${summary:0:1500}

case $rc in
  0) say info "${summary:-verdict pass}" ; exit 0 ;;
  10) say warning "${summary:-verdict warn}; warnings only: the job starts" ; exit 0 ;;
  11) say err "${summary:-verdict fail}; exit 1: Slurm drains this node" ; exit 1 ;;
  124 | 137) broken "ranklens preflight took more than RANKLENS_PREFLIGHT_TIMEOUT=${timeout_s}s" ;;
  *) broken "ranklens preflight could not run (exit $rc: $(tail -c 500 "$tmp/err" | tr '\n' ' '))" ;;
esac
