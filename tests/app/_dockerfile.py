"""Read deploy/docker/Dockerfile and .dockerignore the way the docker builder does, and replay the
image's build steps on this machine (no docker daemon here or in CI).

- :func:`parse_dockerfile`: stages and their instructions (continuation lines, comment lines
  inside them, JSON and shell forms, ``KEY=value`` pairs), as the reference parser reads them.
- :func:`context_files`: what ``COPY . /src`` sends, with .dockerignore's rules (Go
  ``filepath.Match`` patterns plus ``**``, ``!`` exceptions, the last matching line wins, a
  pattern that matches a folder takes everything below it).
- :class:`Replay`: the stages' steps on a scratch folder standing in for the image's root: COPY
  copies, ``python -m venv`` and ``pip install`` run (a clean virtual environment of the same
  Python minor version as the base image), ``install -d`` runs, ``groupadd``/``useradd`` are
  recorded (never run: they would change this machine's accounts). A RUN command it does not
  know fails the replay, so a changed Dockerfile cannot pass untested.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

# python:3.x-slim's PATH (the base images' ENV)
BASE_PATH = "/usr/local/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ReplayError(AssertionError):
    """The Dockerfile has a step the replay cannot run faithfully."""


@dataclass
class Instruction:
    keyword: str  # upper case: RUN, COPY, ...
    args: str  # the rest of the (joined) line
    line: int  # where it starts in the file

    def exec_form(self) -> list[str] | None:
        """The JSON ("exec") form's argument list, None for the shell form."""
        if self.args.lstrip().startswith("["):
            value = json.loads(self.args)
            if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                raise ReplayError(f"line {self.line}: {self.keyword} {self.args}: not a JSON list of strings")
            return value
        return None

    def pairs(self) -> dict[str, str]:
        """``KEY=value`` pairs (LABEL, ENV), quotes removed."""
        out = {}
        for word in shlex.split(self.args):
            key, eq, value = word.partition("=")
            if not eq:
                raise ReplayError(f"line {self.line}: {self.keyword} {word!r}: use KEY=value")
            out[key] = value
        return out


@dataclass
class Stage:
    base: str
    name: str | None
    line: int
    steps: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [s for s in self.steps if s.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


def parse_dockerfile(text: str) -> list[Stage]:
    """The stages of a Dockerfile (default escape character ``\\``)."""
    stages: list[Stage] = []
    logical: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue  # comment lines (and parser directives) are dropped, also inside a continuation
        if not buf:
            start = n
        if raw.rstrip().endswith("\\"):
            buf.append(raw.rstrip()[:-1])
            continue
        buf.append(raw)
        logical.append((start, " ".join(part.strip() for part in buf)))
        buf = []
    if buf:
        raise ReplayError(f"line {start}: the file ends inside a continued line")
    for n, line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            words = args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            if len(words) not in (1, 3) or (len(words) == 3 and name is None):
                raise ReplayError(f"line {n}: FROM {args}: expected FROM image [AS name]")
            stages.append(Stage(words[0], name, n))
        elif not stages:
            raise ReplayError(f"line {n}: {keyword} before the first FROM")
        else:
            stages[-1].steps.append(Instruction(keyword, args.strip(), n))
    return stages


# --- .dockerignore ------------------------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """Go's filepath.Match syntax plus ``**`` (any number of folders), as moby's patternmatcher."""
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                out += "(?:.*/)?"
                i += 1
            else:
                out += ".*"
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                raise ReplayError(f".dockerignore: {pattern!r}: unterminated [")
            body = pattern[i + 1 : end]
            out += "[" + ("^" + body[1:] if body.startswith("^") else body) + "]"
            i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


def _rules(text: str) -> list[tuple[bool, str]]:
    """(exception, pattern) per line, in file order, patterns cleaned as the builder does."""
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        rules.append((exception, os.path.normpath(line[1:].strip() if exception else line).lstrip("/")))
    return rules


def read_dockerignore(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """(exception, regex) per rule, in file order."""
    return [(exception, _pattern_regex(pattern)) for exception, pattern in _rules(text)]


def _may_reinclude(pattern: str, folder: str) -> bool:
    """Whether an exception pattern could take back something below an ignored ``folder``."""
    head = pattern[: len(folder) + 1]
    return pattern.startswith(folder + "/") or any(c in head for c in "*?[\\")


def ignored(rel: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether the context path ``rel`` (``a/b/c``) is left out: the last rule that matches it or
    one of its parent folders decides."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: k + 1]) for k in range(len(parts))]
    out = False
    for exception, rx in rules:
        if any(rx.match(p) for p in prefixes):
            out = not exception
    return out


def context_files(root: Path, dockerignore: str) -> list[str]:
    """The files (relative paths) the build context sends, sorted."""
    rules = read_dockerignore(dockerignore)
    exceptions = [pattern for exception, pattern in _rules(dockerignore) if exception]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        # an ignored folder no exception reaches into is not walked (as the builder skips it)
        dirnames[:] = sorted(
            d
            for d in dirnames
            if not ignored(rel_dir + d, rules) or any(_may_reinclude(p, rel_dir + d) for p in exceptions)
        )
        for name in filenames:
            rel = rel_dir + name
            if not ignored(rel, rules):
                files.append(rel)
    return sorted(files)


# --- the replay ---------------------------------------------------------------------------------


def python_minor(base: str) -> tuple[int, int]:
    """(3, 11) for python:3.11.14-slim-bookworm (an image that is not python:<version>... fails)."""
    m = re.fullmatch(r"(?:docker\.io/)?(?:library/)?python:(\d+)\.(\d+)(?:\.\d+)?[^@]*(?:@sha256:[0-9a-f]{64})?", base)
    if not m:
        raise ReplayError(f"FROM {base}: the replay knows the python:<version> images only")
    return int(m.group(1)), int(m.group(2))


@dataclass
class Account:
    uid: int
    gid: int
    home: str


class Replay:
    """The image's steps, with ``root`` standing in for the image's ``/``.

    Args:
        root: an empty folder; image paths ``/x`` become ``root/x``.
        context: the build context's files (already filtered by .dockerignore).
        python: an interpreter of the base image's Python minor version (for ``python``).
    """

    def __init__(self, root: Path, context: Path, python: str) -> None:
        self.root, self.context, self.python = root, context, python
        self.env: dict[str, str] = {"PATH": BASE_PATH}
        self.groups: dict[str, int] = {}
        self.users: dict[str, Account] = {}
        self.user: tuple[int, int] = (0, 0)
        self.log: list[str] = []

    def at(self, image_path: str) -> Path:
        if not image_path.startswith("/"):
            raise ReplayError(f"{image_path!r}: the replay wants absolute image paths")
        return self.root / image_path.lstrip("/")

    def map_arg(self, arg: str) -> str:
        """An argument naming an image path (``/src[collector,cli]`` too) as a path under root."""
        return str(self.at(arg)) if arg.startswith("/") else arg

    def build(self, stages: list[Stage]) -> Stage:
        """Run every stage; return the final one. A path a build stage wrote that the final stage
        does not ``COPY --from`` is removed, as the image does not contain it."""
        *builders, final = stages
        names = {s.name for s in builders}
        for stage in builders:
            self.stage(stage, final=False)
        carried = set()
        for step in final.all("COPY"):
            words = step.args.split()
            if words and words[0].startswith("--from="):
                if words[0].removeprefix("--from=") not in names or len(words) != 3:
                    raise ReplayError(f"line {step.line}: COPY {step.args}: expected --from=<stage> <path> <path>")
                if words[1] != words[2]:
                    # a virtual environment is not relocatable: its scripts name its interpreter
                    raise ReplayError(f"line {step.line}: COPY --from to another path ({words[1]} -> {words[2]})")
                carried.add(words[1])
        for stage in builders:
            for step in stage.all("COPY"):
                dest = step.args.split()[-1]
                if dest not in carried:
                    shutil.rmtree(self.at(dest), ignore_errors=True)
        self.env = {"PATH": BASE_PATH}
        self.stage(final, final=True)
        return final

    def stage(self, stage: Stage, *, final: bool) -> None:
        for step in stage.steps:
            handler = getattr(self, f"_{step.keyword.lower()}", None)
            if handler is None:
                if step.keyword in ("LABEL", "EXPOSE", "STOPSIGNAL", "HEALTHCHECK", "ENTRYPOINT", "CMD"):
                    continue  # metadata: the tests read it from the parsed file
                raise ReplayError(f"line {step.line}: the replay does not know {step.keyword}")
            handler(step, final)

    def _copy(self, step: Instruction, final: bool) -> None:
        words = step.args.split()
        if words[0].startswith("--from="):
            return  # same path, same root (checked in build)
        if any(w.startswith("--") for w in words) or len(words) != 2:
            raise ReplayError(f"line {step.line}: COPY {step.args}: the replay knows COPY <src> <dest>")
        src, dest = words
        source = self.context if src == "." else self.context / src
        if not source.exists():
            raise ReplayError(f"line {step.line}: COPY {src}: not in the build context (see .dockerignore)")
        target = self.at(dest)
        if source.is_dir():
            shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
            os.chmod(target, 0o644)  # COPY keeps the mode; a checkout's file is 0644 anyway
        for d in target.parents:  # folders COPY creates are 0755
            if d == self.root:
                break
            os.chmod(d, 0o755)

    def _env(self, step: Instruction, final: bool) -> None:
        for key, value in step.pairs().items():
            self.env[key] = re.sub(r"\$\{?(\w+)\}?", lambda m: self.env.get(m.group(1), ""), value)

    def _user(self, step: Instruction, final: bool) -> None:
        uid, _, gid = step.args.partition(":")
        if not (uid.isdigit() and gid.isdigit()):
            raise ReplayError(f"line {step.line}: USER {step.args}: use numeric uid:gid (runAsNonRoot checks it)")
        self.user = (int(uid), int(gid))

    def _run(self, step: Instruction, final: bool) -> None:
        if step.exec_form() is not None:
            raise ReplayError(f"line {step.line}: RUN in exec form: the replay knows the shell form")
        words = shlex.split(step.args)
        commands: list[list[str]] = [[]]
        for w in words:
            if w == "&&":
                commands.append([])
            elif w in ("||", ";", "|", "&") or w.endswith(";"):
                raise ReplayError(f"line {step.line}: RUN: the replay knows `a && b` chains only")
            else:
                commands[-1].append(w)
        for argv in commands:
            self._command(argv, step)

    def _command(self, argv: list[str], step: Instruction) -> None:
        prog = argv[0]
        if argv[:3] == ["python", "-m", "venv"] and len(argv) == 4:
            self._exec([self.python, "-m", "venv", self.map_arg(argv[3])])
        elif prog.startswith("/") and prog.endswith("/bin/pip") and argv[1:2] == ["install"]:
            if "--no-cache-dir" not in argv:
                raise ReplayError(f"line {step.line}: pip install without --no-cache-dir leaves its cache in the layer")
            self._exec([self.map_arg(a) for a in argv])
        elif prog == "groupadd":
            opts, name = _options(argv[1:], step, flags={"--system"}, valued={"--gid"})
            self.groups[name] = int(opts["--gid"])
        elif prog == "useradd":
            opts, name = _options(
                argv[1:],
                step,
                flags={"--system", "--no-create-home"},
                valued={"--uid", "--gid", "--home-dir", "--shell"},
            )
            gid = int(opts["--gid"])
            if gid not in self.groups.values():
                raise ReplayError(f"line {step.line}: useradd --gid {gid}: no such group yet")
            self.users[name] = Account(int(opts["--uid"]), gid, opts.get("--home-dir", f"/home/{name}"))
        elif prog == "install" and "-d" in argv:
            opts, path = _options(argv[1:], step, flags={"-d"}, valued={"-o", "-g", "-m"})
            owner, group = _id(opts.get("-o", "0"), self.users), _gid(opts.get("-g", "0"), self.groups)
            target = self.at(path)
            self._exec(["install", "-d", "-m", opts.get("-m", "0755"), str(target)])
            os.chown(target, owner, group)
            for d in target.parents:  # install -d makes the parents 0755 root:root
                if d == self.root:
                    break
                os.chmod(d, 0o755)
        else:
            raise ReplayError(f"line {step.line}: the replay does not know the command {shlex.join(argv)!r}")

    def _exec(self, argv: list[str]) -> None:
        self.log.append(shlex.join(argv))
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise AssertionError(f"{shlex.join(argv)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")

    def container_env(self, extra: dict[str, str]) -> dict[str, str]:
        """The container's environment: the image's ENV (PATH entries the image created mapped
        under root; the rest stand for the base image's own folders), HOME from the user's
        account as docker sets it, then ``docker run -e`` values."""
        env = dict(self.env)
        env["PATH"] = os.pathsep.join(
            str(self.at(p)) if p.startswith("/") and self.at(p).exists() else p for p in env["PATH"].split(":")
        )
        home = next((a.home for a in self.users.values() if a.uid == self.user[0]), "/")
        env["HOME"] = home
        env.update(extra)
        return env

    def resolve(self, argv: list[str], env: dict[str, str]) -> list[str]:
        """An exec-form command line as the container runs it: the program looked up on PATH,
        arguments naming files the image holds mapped under root."""
        prog = shutil.which(argv[0], path=env["PATH"])
        if prog is None:
            raise AssertionError(f"{argv[0]!r} is not on the image's PATH {env['PATH']}")
        return [prog] + [str(self.at(a)) if a.startswith("/") and self.at(a).exists() else a for a in argv[1:]]


def _options(args: list[str], step: Instruction, *, flags: set[str], valued: set[str]) -> tuple[dict[str, str], str]:
    opts: dict[str, str] = {}
    rest = []
    it = iter(args)
    for a in it:
        if a in flags:
            opts[a] = ""
        elif a in valued:
            opts[a] = next(it)
        elif a.startswith("-"):
            raise ReplayError(f"line {step.line}: option {a} unknown to the replay")
        else:
            rest.append(a)
    if len(rest) != 1:
        raise ReplayError(f"line {step.line}: expected one operand, got {rest}")
    return opts, rest[0]


def _id(value: str, users: dict[str, Account]) -> int:
    return int(value) if value.isdigit() else users[value].uid


def _gid(value: str, groups: dict[str, int]) -> int:
    return int(value) if value.isdigit() else groups[value]
