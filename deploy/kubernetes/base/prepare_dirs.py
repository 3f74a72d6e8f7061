"""Make the node's ranklens directories usable by the collector and by the training pods.

Run by the collector DaemonSet's initContainer (same image, as root with only CAP_CHOWN and
CAP_FOWNER, runAsGroup = the spool group, no privilege escalation) before the collector starts:

    python3 /opt/ranklens-init/prepare_dirs.py --uid 65532 --gid 65532 DIR...

Why: a ``hostPath`` volume of type ``DirectoryOrCreate`` is made by the kubelet as root:root 0755,
and ``fsGroup`` does not apply to hostPath volumes, so the collector (uid 65532) could not write
its spool. For each DIR this makes (idempotently, touching nothing below DIR itself):

* owner ``uid``, group ``gid``, mode 2775: the collector owns it; a training pod that has ``gid``
  in its ``supplementalGroups`` can create its job's directory in it; the setgid bit makes every
  file and directory created beneath it belong to group ``gid`` as well;
* POSIX ACLs ``user:uid:rwx``, ``group:gid:rwx`` on DIR and as its *default* ACL, inherited by
  everything created beneath: with a default ACL the kernel ignores the creating process's umask
  for those entries, so a rank's spool directory made under the usual umask 022 still lets the
  collector delete the segments it shipped (deleting needs write access to the directory).

A file system without POSIX ACLs (ENOTSUP) keeps the owner, group and mode; the training pods must
then create their files with umask 0002, and a warning says so. Exit status 0 when DIR is ready,
1 (with the reason) when it is not.
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
import struct
import sys

MODE = 0o2775  # rwxrwsr-x
# Linux's POSIX ACL extended attribute (include/uapi/linux/posix_acl_xattr.h): a little-endian
# version 2 header, then (tag u16, perm u16, id u32) entries sorted by tag, then id.
_ACL_VERSION = 2
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_NO_ID = 0xFFFFFFFF
ACCESS, DEFAULT = "system.posix_acl_access", "system.posix_acl_default"


def acl_xattr(uid: int, gid: int) -> bytes:
    """The ACL ``u::rwx,u:<uid>:rwx,g::rwx,g:<gid>:rwx,m::rwx,o::r-x`` as the kernel stores it."""
    entries = [
        (_USER_OBJ, 7, _NO_ID),
        (_USER, 7, uid),
        (_GROUP_OBJ, 7, _NO_ID),
        (_GROUP, 7, gid),
        (_MASK, 7, _NO_ID),
        (_OTHER, 5, _NO_ID),
    ]
    return struct.pack("<I", _ACL_VERSION) + b"".join(struct.pack("<HHI", *e) for e in entries)


def prepare(path: str, uid: int, gid: int) -> list[str]:
    """Prepare one directory; returns warnings. Raises OSError (or ValueError) when it cannot."""
    warnings: list[str] = []
    os.makedirs(path, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{path} is not a directory")
    os.chown(path, uid, gid)
    blob = acl_xattr(uid, gid)
    try:
        for name in (ACCESS, DEFAULT):
            os.setxattr(path, name, blob)
    except OSError as e:
        if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        warnings.append(
            f"{path}: the file system has no POSIX ACLs ({e.strerror}); training pods must write "
            "with umask 0002, or the collector cannot delete the segments it shipped"
        )
    # chmod last: setting an ACL may clear the setgid bit, and chmod keeps it only for a process
    # in the directory's group (runAsGroup = gid) or one with CAP_FSETID (not granted).
    os.chmod(path, MODE)
    st = os.stat(path)
    if (st.st_uid, st.st_gid) != (uid, gid) or stat.S_IMODE(st.st_mode) != MODE:
        raise ValueError(
            f"{path} is {st.st_uid}:{st.st_gid} {stat.S_IMODE(st.st_mode):04o}, not {uid}:{gid} {MODE:04o} "
            f"(the setgid bit is kept only when this runs with group {gid}: set runAsGroup: {gid})"
        )
    return warnings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Make ranklens' hostPath directories usable by the collector.")
    p.add_argument("--uid", type=int, default=65532, help="the collector's user id (default 65532)")
    p.add_argument("--gid", type=int, default=65532, help="the spool group, shared with training pods (default 65532)")
    p.add_argument("dirs", nargs="+", metavar="DIR")
    args = p.parse_args(argv)
    failed = False
    for d in args.dirs:
        try:
            for w in prepare(d, args.uid, args.gid):
                print(f"prepare_dirs: warning: {w}", file=sys.stderr)
            print(f"prepare_dirs: {d} ready ({args.uid}:{args.gid} {MODE:04o})")
        except (OSError, ValueError) as e:
            print(f"prepare_dirs: {d}: {e}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
