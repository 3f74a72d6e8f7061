"""deploy/docker/Dockerfile builds from the repository and its container needs no network.

There is no docker daemon here or in CI, so the build's steps are replayed (tests/app/_dockerfile.py):
the build context as .dockerignore filters it, the pip step in a clean virtual environment of the
base image's Python, then ENTRYPOINT + CMD as the image's user (65532) in a network namespace with
loopback only: the collector must start with what the image installed, serve /metrics, satisfy
the HEALTHCHECK, and exit 0 on the STOPSIGNAL.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import tomllib

from ranklens.collector.agent import load_config
from tests.app._dockerfile import Replay, context_files, ignored, parse_dockerfile, python_minor, read_dockerignore

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
FAKE_GPU = "GPU-00000000-0000-0000-0000-000000000000"  # fake_nvml's first device


def _stages():
    return parse_dockerfile(DOCKERFILE.read_text())


def _final():
    return _stages()[-1]


def _healthcheck_argv(stage) -> list[str]:
    (hc,) = stage.all("HEALTHCHECK")
    _, sep, cmd = hc.args.partition("CMD ")
    assert sep, f"HEALTHCHECK {hc.args}: expected options then CMD [...]"
    argv = json.loads(cmd)
    return argv


def _image_config(tmp_path: Path):
    """The collector config the image ships, loaded by the collector's own loader."""
    (copy,) = [s for s in _final().all("COPY") if s.args.endswith("/etc/ranklens/collector.toml")]
    src = ROOT / copy.args.split()[0]
    return load_config(src)


def test_dockerfile_follows_the_usual_practice(tmp_path):
    stages = _stages()
    build, final = stages[0], stages[-1]
    # the base is pinned to a patch release and a Debian release, the same in every stage (the
    # virtual environment is copied between them and names its interpreter)
    assert {s.base for s in stages} == {final.base}
    assert python_minor(final.base) == (3, 11)
    version = final.base.split(":", 1)[1]
    assert (version.count(".") == 2 and version.endswith(("-bookworm", "-trixie"))) or "@sha256:" in final.base
    # pip leaves no cache in a layer; the final stage installs nothing itself
    assert any("pip install --no-cache-dir" in r.args for r in build.all("RUN"))
    assert not any("pip" in r.args for r in final.all("RUN"))
    # non-root, numeric (Kubernetes' runAsNonRoot can only check a number), and the account exists
    user = final.last("USER").args
    uid, gid = (int(x) for x in user.split(":"))
    assert uid != 0 and gid != 0
    assert f"--uid {uid} --gid {gid}" in " ".join(r.args for r in final.all("RUN"))
    assert final.steps.index(final.last("USER")) > max(final.steps.index(r) for r in final.all("RUN"))
    # OCI labels true to the project
    labels = {k: v for step in final.all("LABEL") for k, v in step.pairs().items()}
    assert labels["org.opencontainers.image.version"] == PYPROJECT["project"]["version"]
    assert labels["org.opencontainers.image.licenses"] == PYPROJECT["project"]["license"]
    assert labels["org.opencontainers.image.title"] == "ranklens"
    assert labels["org.opencontainers.image.base.name"].endswith(final.base)
    # stopped by SIGTERM, which the collector turns into a bounded flush
    assert final.last("STOPSIGNAL").args == "SIGTERM"
    # the port the shipped config serves is the one exposed and health-checked
    cfg = _image_config(tmp_path)
    assert final.last("EXPOSE").args == str(cfg.metrics_port) == "9400"
    assert f"127.0.0.1:{cfg.metrics_port}/metrics" in " ".join(_healthcheck_argv(final))
    assert cfg.shutdown_timeout_s < 10  # within `docker stop`'s default grace period
    assert cfg.spool_dir == "/var/lib/ranklens/spool"
    # the default command is the collector on that config
    assert final.last("ENTRYPOINT").exec_form() == ["ranklens"]
    assert final.last("CMD").exec_form() == ["collector", "--config", "/etc/ranklens/collector.toml"]


def test_build_context_is_what_the_build_needs_and_nothing_else():
    files = context_files(ROOT, (ROOT / ".dockerignore").read_text())
    tops = {f.split("/", 1)[0] for f in files}
    # every package folder pyproject installs, and the readme it names
    package_dirs = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    assert package_dirs <= tops
    assert {"pyproject.toml", PYPROJECT["project"]["readme"]} <= set(files)
    for step in _final().all("COPY"):
        src = step.args.split()[0]
        if not src.startswith("--from="):
            assert src in files, f"COPY {src}: left out of the context by .dockerignore"
    # nothing of the working tree's own state, tests or run-time data
    for f in files:
        assert not f.startswith((".venv/", ".git/", "artifacts/", "tests/", "ranklens.egg-info/", ".mypy_cache/"))
        assert "__pycache__" not in f and not f.endswith(".pyc") and "ranklens-store" not in f
    size = sum((ROOT / f).stat().st_size for f in files)
    assert size < 5 * 2**20, f"the build context is {size / 2**20:.1f} MiB"


@pytest.mark.parametrize(
    ("rules", "path", "out"),
    [
        ("*\n!pkg", "pkg/a/b.py", False),  # an exception for a folder takes what is below it
        ("*\n!pkg", "other/b.py", True),
        ("*\n!pkg\n**/__pycache__", "pkg/sub/__pycache__/m.pyc", True),  # ** spans folders
        ("**/*.py[cod]", "m.pyc", True),  # ... including none
        ("pkg\n!pkg/keep.txt", "pkg/keep.txt", False),  # the last matching line wins
        ("!pkg/keep.txt\npkg", "pkg/keep.txt", True),
        ("/build", "build/x", True),  # a leading / is the context's root
        ("*.md", "docs/a.md", False),  # * stays within one folder
        ("a?c", "abc", True),
    ],
)
def test_dockerignore_rules_read_as_docker_reads_them(rules, path, out):
    assert ignored(path, read_dockerignore(rules)) is out


def _base_python(version: tuple[int, int], uid: int, gid: int) -> str:
    """An interpreter of the base image's Python minor version that the image's user can run (in
    the image it is /usr/local/bin/python, readable by all; a pyenv build under /root is not)."""
    want = f"{version[0]}.{version[1]}"
    candidates = [
        getattr(sys, "_base_executable", sys.executable),
        shutil.which(f"python{want}"),
        f"/usr/bin/python{want}",
    ]
    for exe in dict.fromkeys(c for c in candidates if c and os.path.exists(c)):
        probe = "import sys, venv, ensurepip; print('%d.%d' % sys.version_info[:2])"
        try:
            r = subprocess.run(
                [exe, "-c", probe],
                user=uid,
                group=uid,
                extra_groups=[],
                cwd="/",
                capture_output=True,
                text=True,
                timeout=60,
            )
        except OSError:
            continue
        if r.returncode == 0 and r.stdout.strip() == want:
            return exe
    pytest.fail(f"the image's Python is {want}: the replay needs a python{want} with venv that uid {uid} can run")


@pytest.fixture
def image_root():
    # outside pytest's tmp_path: that is 0700 root's, and the container's user must read the image
    root = Path(tempfile.mkdtemp(prefix="ranklens-image-"))
    os.chmod(root, 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_image_builds_from_the_repository_and_runs_the_collector_offline_as_its_user(image_root):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (util-linux) for the image's user and its network namespace")
    stages = _stages()
    final = stages[-1]
    t0 = time.monotonic()
    context = image_root / "context"
    for rel in context_files(ROOT, (ROOT / ".dockerignore").read_text()):
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, context / rel)
    rootfs = image_root / "rootfs"
    rootfs.mkdir(mode=0o755)
    image_uid, image_gid = (int(x) for x in final.last("USER").args.split(":"))
    replay = Replay(rootfs, context, _base_python(python_minor(final.base), image_uid, image_gid))
    replay.build(stages)
    build_s = time.monotonic() - t0

    # the environment is clean (no system site packages) and the source is not in the image
    venv = rootfs / "opt" / "ranklens"
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    assert not (rootfs / "src").exists()
    uid, gid = replay.user
    assert uid == 65532 and (uid, gid) in {(a.uid, a.gid) for a in replay.users.values()}
    spool = rootfs / "var" / "lib" / "ranklens" / "spool"
    assert (spool.stat().st_uid, spool.stat().st_gid) == (uid, gid)
    shutil.rmtree(context)  # nothing below runs from the build context

    # `docker run -e RANKLENS_STORE=... -e RANKLENS_HOST=... -v <spool>:/var/lib/ranklens/spool`:
    # the store is a ClickHouse server that is not there (no network), which the collector outlives;
    # the volume is the image's own spool folder, named through the config override variable.
    # The GPUs are fake_nvml's, put in place of the NVML driver (pynvml) by a sitecustomize: the
    # one boundary this machine cannot provide.
    shim = image_root / "gpu-shim"
    shim.mkdir(mode=0o755)
    (shim / "sitecustomize.py").write_text(
        "import sys\nfrom ranklens.collector.fake_nvml import fake_nvml\nsys.modules['pynvml'] = fake_nvml(2)\n"
    )
    os.chmod(shim / "sitecustomize.py", 0o644)
    env = replay.container_env(
        {
            "RANKLENS_STORE": "clickhouse://ranklens@127.0.0.1:9000/ranklens",
            "RANKLENS_HOST": "gpu-node-7",
            "RANKLENS_COLLECTOR_SPOOL_DIR": str(spool),
            "PYTHONPATH": str(shim),
        }
    )
    argv = replay.resolve(final.last("ENTRYPOINT").exec_form() + final.last("CMD").exec_form(), env)
    assert argv[0] == str(venv / "bin" / "ranklens")
    # the image is the CLI too: `docker run ranklens/ranklens:0.1.0 version`
    r = subprocess.run(
        replay.resolve([*final.last("ENTRYPOINT").exec_form(), "version"], env),
        env=env,
        user=uid,
        group=gid,
        extra_groups=[],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and PYPROJECT["project"]["version"] in r.stdout, r.stdout + r.stderr
    cfg = _image_config(image_root)
    spec = {
        "argv": argv,
        "env": env,
        "uid": uid,
        "gid": gid,
        "health": replay.resolve(_healthcheck_argv(final), env),
        "metrics_url": f"http://127.0.0.1:{cfg.metrics_port}/metrics",
        "stop_signal": final.last("STOPSIGNAL").args,
        "ready_timeout_s": 60,
        "stop_timeout_s": cfg.shutdown_timeout_s + 10,
        "log": str(image_root / "container.log"),
        "wait_for": FAKE_GPU,
    }
    (image_root / "spec.json").write_text(json.dumps(spec))
    t1 = time.monotonic()
    r = subprocess.run(
        ["unshare", "--net", sys.executable, str(ROOT / "tests/app/_image_smoke.py"), str(image_root / "spec.json")],
        capture_output=True,
        text=True,
        timeout=180,
    )
    run_s = time.monotonic() - t1
    log = (image_root / "container.log").read_text(errors="replace")
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\ncontainer log:\n{log[-3000:]}"
    seen = json.loads(r.stdout)
    print(f"image replay: build {build_s:.1f} s, container {run_s:.1f} s (ready {seen['ready_s']} s)")
    assert seen["outside"] in ("ENETUNREACH", "EHOSTUNREACH"), seen["outside"]  # no network but loopback
    assert seen["metrics"] is not None, f"/metrics never answered:\n{log[-3000:]}"
    metrics = seen["metrics"]
    assert "ranklens_collector_nvml_available 1.0" in metrics
    assert any(line.startswith("ranklens_gpu_") and FAKE_GPU in line for line in metrics.splitlines()), metrics
    assert seen["health_up"] == 0  # HEALTHCHECK passes while it serves
    assert seen["rc"] == 0, f"exit {seen['rc']} after {spec['stop_signal']}:\n{log[-3000:]}"
    assert seen["health_down"] != 0  # ... and fails once it is gone
    assert "Traceback" not in log, log[-3000:]
    # the collector, as the image's user, kept its samples in the spool for the store to come
    written = [p for p in spool.rglob("*.jsonl")]
    assert written and all(p.stat().st_uid == uid for p in written), sorted(spool.rglob("*"))
