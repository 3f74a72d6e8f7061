"""deploy/slurm/: the node collector's systemd unit, its user and folders, its config, and the job
script, checked with systemd's own tools and by running the job script without Slurm."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
from configparser import ConfigParser
from pathlib import Path

import pytest

from ranklens.cli import cli
from ranklens.collector.agent import load_config
from tests._jobs import GLOO_TEARDOWN_ABORT, TORCHRUN
from tests._sync import free_port

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "deploy" / "slurm"
UNIT = SLURM / "ranklens-collector.service"
RANKLENS = str(Path(sys.executable).with_name("ranklens"))


def _unit() -> ConfigParser:
    # systemd unit files are ini-like; keys may repeat (none of ours do) and are case-sensitive
    parser = ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(UNIT.read_text())
    return parser


def _exec_start() -> list[str]:
    return shlex.split(_unit()["Service"]["ExecStart"])


def test_unit_runs_the_collector_on_the_shipped_config_as_its_own_user():
    svc = _unit()["Service"]
    argv = _exec_start()
    assert argv[0] == "/opt/ranklens/bin/ranklens" and argv[1] == "collector"
    # the command line is one `ranklens collector` accepts (click parses and checks every option),
    # with the shipped config where docs/slurm.md installs it
    assert argv[argv.index("--config") + 1] == "/etc/ranklens/collector.toml"
    args = [str(SLURM / "collector.toml") if a == "/etc/ranklens/collector.toml" else a for a in argv[2:]]
    ctx = cli.commands["collector"].make_context("collector", args)
    assert ctx.params["log_format"] == "json"
    cfg = load_config(SLURM / "collector.toml")  # the loader rejects any unknown key or bad value
    # its user is the one sysusers.d creates; its state folder holds the spool
    (user_line,) = [
        line for line in (SLURM / "ranklens.sysusers.conf").read_text().splitlines() if line.startswith("u ")
    ]
    assert svc["User"] == svc["Group"] == user_line.split()[1] == "ranklens"
    assert svc["StateDirectory"] == "ranklens" and cfg.spool_dir.startswith("/var/lib/ranklens/")
    # SIGTERM flushes within shutdown_timeout_s, before systemd's SIGKILL
    assert svc["KillSignal"] == "SIGTERM" and int(svc["TimeoutStopSec"]) > cfg.shutdown_timeout_s
    # bad configuration is not retried in a loop (exit code 2; 5: schema mismatch)
    assert set(svc["RestartPreventExitStatus"].split()) == {"2", "5"}
    # the store comes from the environment file; the example names what it must hold
    assert svc["EnvironmentFile"] == "/etc/ranklens/collector.env"
    env = dict(
        line.split("=", 1)
        for line in (SLURM / "collector.env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert env["RANKLENS_STORE"].startswith("clickhouse://") and "RANKLENS_STORE_PASSWORD" in env
    assert "@" in env["RANKLENS_STORE"] and ":" not in env["RANKLENS_STORE"].split("//")[1].split("@")[0]
    # hardened, but NVML's devices and the ranks' /proc stay visible
    assert svc["NoNewPrivileges"] == "yes" and svc["ProtectSystem"] == "strict" and svc["CapabilityBoundingSet"] == ""
    assert "PrivateDevices" not in svc and "ProtectProc" not in svc
    # the logs it follows: the job script's per-node output files
    sbatch = (SLURM / "train.sbatch").read_text()
    assert cfg.logs[0].glob == "/var/log/training/slurm-*.log"
    assert "LOG_DIR=${LOG_DIR:-/var/log/training}" in sbatch and '--output="${LOG_DIR}/slurm-%j-%N.log"' in sbatch
    assert cfg.metrics_port == 9400


def test_unit_passes_systemd_analyze_verify_and_security(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (the systemd package)")
    # verify wants ExecStart's program to exist: the same unit, with this environment's ranklens
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/ranklens/bin/ranklens", RANKLENS))
    r = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    # an unknown key or a bad value is only a warning to verify: any output is a failure here
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr
    r = subprocess.run(
        [tool, "security", "--offline=yes", "--threshold=30", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr  # exposure 3.0 or less ("OK")


def test_sysusers_and_tmpfiles_let_jobs_write_the_spool_and_the_collector_empty_it(tmp_path):
    for tool in ("systemd-sysusers", "systemd-tmpfiles"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (the systemd package)")
    if os.geteuid() != 0:
        pytest.skip("needs root to act as a job's user and as the collector's")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    for name in ("passwd", "group", "shadow", "gshadow"):
        (root / "etc" / name).touch()
    os.chmod(tmp_path, 0o755)
    os.chmod(root, 0o755)
    conf = (SLURM / "ranklens.sysusers.conf").read_text()
    r = subprocess.run(["systemd-sysusers", f"--root={root}", "-"], input=conf, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    entry = next(line for line in (root / "etc/passwd").read_text().splitlines() if line.startswith("ranklens:"))
    uid, gid = int(entry.split(":")[2]), int(entry.split(":")[3])
    # tmpfiles finds the user in the scratch root, but the ACL text is parsed with this machine's
    # user database, which has no ranklens: the same entries, with its number
    tmpfiles = (SLURM / "ranklens.tmpfiles.conf").read_text()
    assert "u:ranklens:rwx" in tmpfiles
    r = subprocess.run(
        ["systemd-tmpfiles", "--create", f"--root={root}", "-"],
        input=tmpfiles.replace("u:ranklens:", f"u:{uid}:"),
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    spool = root / "var/lib/ranklens/spool"
    st = spool.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (uid, gid, 0o1777)
    assert (root / "var/log/training").stat().st_mode & 0o7777 == 0o1777

    def sh(user: int, script: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["/bin/sh", "-c", script], user=user, group=user, extra_groups=[], cwd=spool, capture_output=True, text=True
        )

    # a job's user, with the tightest umask, writes a rank's segment as the tracer does
    job_user, other_user = 4101, 4102
    seg = "slurm-7/0/rank-3/collectives.123.456.jsonl"
    r = sh(job_user, f"umask 077 && mkdir -p {os.path.dirname(seg)} && echo '{{}}' > {seg}")
    assert r.returncode == 0, r.stderr
    # another job's user cannot remove it (sticky spool) ...
    assert sh(other_user, "rm -rf slurm-7").returncode != 0 and (spool / seg).exists()
    # ... the collector can read it, delete it once shipped, and remove the emptied folders
    r = sh(uid, f"cat {seg} && rm {seg} && rmdir slurm-7/0/rank-3 slurm-7/0 slurm-7")
    assert r.returncode == 0, r.stderr
    assert not (spool / "slurm-7").exists()


def test_job_script_is_valid_bash():
    r = subprocess.run(["bash", "-n", str(SLURM / "train.sbatch")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


FAKE_SRUN = r"""#!/bin/bash
# srun for one node: --kill-on-bad-exit and --output=PATTERN (%j, %N), then the command
set -eu
out=
while [ $# -gt 0 ]; do
  case "$1" in
    --kill-on-bad-exit=*) shift ;;
    --output=*) out=${1#--output=}; shift ;;
    -*) echo "fake srun: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
out=${out//%j/$SLURM_JOB_ID}
out=${out//%N/$(hostname -s)}
exec "$@" > "$out" 2>&1
"""

FAKE_SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] || { echo "fake scontrol: $*" >&2; exit 2; }
tr ',' '\\n' <<< "$3"
"""

TRAIN = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
if dist.get_rank() == 1:
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_job_script_traces_a_torchrun_job_without_slurm(tmp_path):
    """The sbatch script as Slurm's batch step runs it (SLURM_* set by hand, one node, srun and
    scontrol stand-ins that do what they do for one node), with a 2-rank gloo job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "train.py").write_text(TRAIN)
    for attempt in range(2):
        logs, spool = tmp_path / f"logs{attempt}", tmp_path / f"spool{attempt}"
        logs.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANKLENS_", "SLURM_", "TORCHELASTIC_"))}
        env.update(
            PATH=os.pathsep.join([str(bin_dir), str(Path(TORCHRUN).parent), env.get("PATH", "")]),
            SLURM_JOB_ID="4242",
            SLURM_NNODES="1",
            SLURM_JOB_NODELIST="localhost",
            RANKLENS=RANKLENS,
            GPUS_PER_NODE="2",
            LOG_DIR=str(logs),
            RANKLENS_SPOOL=str(spool),
            RDZV_PORT=str(free_port()),
            OMP_NUM_THREADS="1",
        )
        r = subprocess.run(
            ["bash", str(SLURM / "train.sbatch"), str(tmp_path / "train.py")],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=240,
        )
        (log,) = logs.glob("slurm-4242-*.log")
        assert log.name == f"slurm-4242-{socket.gethostname().split('.')[0]}.log"
        text = log.read_text()
        if r.returncode == 0 or attempt or GLOO_TEARDOWN_ABORT not in text:
            break
        # a CI run: rank 0 aborted in gloo's teardown after the job's work (not the script's subject)
        print("a rank aborted in gloo's teardown; running the job again", file=sys.stderr)
    assert r.returncode == 0, r.stderr[-3000:] + text[-3000:]
    assert "ranklens run: job slurm-4242, spool" in text
    # the ranks traced under Slurm's job id, each in the node's spool
    ranks = sorted(p.name for p in (spool / "slurm-4242").glob("*/rank-*"))
    assert ranks == ["rank-0", "rank-1"], sorted(spool.rglob("*"))
    for rank in ranks:
        assert list((spool / "slurm-4242").glob(f"*/{rank}/collectives.*.jsonl")), rank
    # the collector's log filter names the rank of a line of the node's one output file
    r = subprocess.run([RANKLENS, "logs", "classify", "--json", str(log)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(e["class"], e["rank"]) for e in events if e["class"] == "cuda_oom"] == [("cuda_oom", 1)], events
