"""An on-disk cache of compiled Hyperscan databases, so a one-shot ``ranklens logs classify`` (or a
collector restart) loads its rules in ~0.1 ms instead of compiling them in ~0.08 s (issue 18).

A cache file is keyed by what the database was compiled from: every expression with its id and
flags, the scan mode, the Hyperscan binding (its version and the build of its extension module)
and this CPU (a database compiled for one instruction set must not be loaded on another). The
file name is a short checksum of that key, and the file holds the whole key too: a file is used
only when its key is byte-for-byte the one asked for and its payload passes its CRC and
Hyperscan's own checks. Anything else (a truncated, corrupt or foreign file, another Hyperscan,
another CPU, an unreadable or read-only directory) means "compile", never a wrong result.

Files are written atomically (a temporary file in the same directory, then ``os.replace``), so
processes racing to fill the cache never read half a file. The default directory is
``$XDG_CACHE_HOME/ranklens/hyperscan`` (``~/.cache/ranklens/hyperscan``), the XDG base-directory
convention that pip and other tools follow.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["HyperscanCache", "default_cache_dir"]


def _log() -> Any:
    # logging is imported when there is something to say: ~4 ms of a one-shot run otherwise
    import logging

    return logging.getLogger("ranklens.collector.logfilter")


_MAGIC = b"ranklens-hsdb 1\n"
_HEAD = struct.Struct("<II")  # key length, CRC-32 of the payload
MAX_FILE_BYTES = 64 << 20  # a bigger file is not one of ours


def default_cache_dir() -> Path | None:
    """``$XDG_CACHE_HOME/ranklens/hyperscan`` (a relative value is ignored, as the XDG spec says),
    else ``~/.cache/ranklens/hyperscan``; None when there is no home directory to put it in."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        home = os.path.expanduser("~")
        if not os.path.isabs(home):
            return None
        base = os.path.join(home, ".cache")
    return Path(base) / "ranklens" / "hyperscan"


def _cpu_id() -> bytes:
    """The CPU's model and feature flags (Linux), which decide the code Hyperscan compiles for."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            head = f.read(32768)
    except OSError:
        return os.uname().machine.encode()
    block = head.split(b"\n\n", 1)[0]  # the first processor
    keep = [ln for ln in block.splitlines() if ln.startswith((b"vendor_id", b"model name", b"flags"))]
    return b"\n".join(keep) or os.uname().machine.encode()


def _binding_id(hs: Any) -> bytes:
    ext = getattr(hs, "_hs_ext", None)
    path = getattr(ext, "__file__", None) or ""
    try:
        st = os.stat(path)
        build = b"%d,%d" % (st.st_size, st.st_mtime_ns)
    except OSError:
        build = b"?"
    return b"%s %s" % (str(getattr(hs, "__version__", "?")).encode(), build)


class HyperscanCache:
    """The cache entry of one expression set.

    Args:
        directory: the cache directory (created, mode 0700, on the first store).
        exprs, ids, flags: what ``hyperscan.Database.compile`` is given.
        mode: the database mode.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        exprs: Sequence[bytes],
        ids: Sequence[int],
        flags: Sequence[int],
        mode: int | None = None,
    ) -> None:
        import hyperscan

        self._hs = hyperscan
        self.mode = hyperscan.HS_MODE_BLOCK if mode is None else mode
        parts = [_MAGIC, b"binding " + _binding_id(hyperscan), b"cpu " + _cpu_id(), b"mode %d" % self.mode]
        # length-prefixed: no expression can run into the next one
        parts += [b"%d %d %d:" % (i, f, len(e)) + e for e, i, f in zip(exprs, ids, flags)]
        self.key = b"\n".join(parts)
        name = f"{zlib.crc32(self.key):08x}{zlib.adler32(self.key):08x}.hsdb"
        self.path = Path(directory) / name

    def load(self) -> Any:
        """The cached database, ready to scan, or None (missing, stale or damaged: compile it)."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        except OSError:
            return None
        db = self._decode(raw)
        if db is None:
            _log().debug("log filter: ignoring the unusable Hyperscan cache file %s", self.path)
        return db

    def _decode(self, raw: bytes) -> Any:
        n = len(_MAGIC)
        if len(raw) > MAX_FILE_BYTES or raw[:n] != _MAGIC or len(raw) < n + _HEAD.size:
            return None
        key_len, crc = _HEAD.unpack_from(raw, n)
        k0 = n + _HEAD.size
        if raw[k0 : k0 + key_len] != self.key:
            return None
        payload = raw[k0 + key_len :]
        if not payload or zlib.crc32(payload) != crc:
            return None
        hs = self._hs
        try:
            db = hs.loadb(payload, self.mode)
            db.scratch = hs.Scratch(db)
        except hs.error:
            return None
        return db

    def store(self, db: Any) -> bool:
        """Write ``db`` to the cache atomically; False (logged at debug) when it cannot be written."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            payload = self._hs.dumpb(db)
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(_MAGIC + _HEAD.pack(len(self.key), zlib.crc32(payload)) + self.key + payload)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            os.replace(tmp, self.path)
        except (OSError, self._hs.error) as e:
            _log().debug("log filter: cannot write the Hyperscan cache %s: %s", self.path, e)
            return False
        return True
