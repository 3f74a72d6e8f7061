"""Link-analysis noise on the real network-namespace bed: how close a healthy job comes to a false
``slow_link`` finding.

    sudo python bench/netbed_noise.py [--scenarios h:10,h:10,t:5,s:7] [--rate 40mbit]

Starts the 4-node x 2-rank gloo bed job of tests/analyzers/test_links_netbed.py once
(tests/links_bed_job.py) and runs its scenarios in the same processes: ``h`` healthy, ``t`` node 3's
link throttled to ``--rate`` with tbf, ``s`` rank 5 computing 150 ms longer from step 1. Ships the
spool into an embedded store, then prints per scenario the slow-link and congestion findings and
every cell the detector judged slow (group, op, window, slowdown, median transfer): on a healthy
scenario each slow cell is noise, and a link whose groups' slow cells line up over two windows is
one step from a false finding; and what the detector would also name without its transient rule
(``transient_k=0``) or without its noise rule (``max_noise_p=1``). Needs root and iproute2 (as the
test). Not run in the test suite.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from ranklens.analyzers.links import compute_link_metrics, find_slow_links
from ranklens.analyzers.netbed import NetBed, unavailable_reason
from ranklens.analyzers.tomography import SLOW, GroupTestingDetector
from ranklens.collector import Shipper
from ranklens.store import open_store
from tests.links_bed import start_bed_job


def run_bed(spec: list[tuple[str, str]], rate: str, tmp: Path) -> tuple[object, str]:
    """Run the scenarios (name, "kind:steps[:rank]") on a fresh bed; the store and job prefix."""
    ctl = tmp / "ctl"
    ctl.mkdir()
    bed = NetBed(4, prefix=f"rln{uuid.uuid4().hex[:5]}")
    bed.up()
    job = f"noise-{uuid.uuid4().hex[:6]}"
    scenarios = ",".join(f"{name}:{rest}" for name, rest in spec)
    try:
        procs = start_bed_job(bed, job=job, ctl=ctl, spool=tmp / "spool", scenarios=scenarios, port=29561)
        throttled = False
        for k, (name, _rest) in enumerate(spec):
            if k > 0:
                want = name.startswith("t")
                if want != throttled:
                    bed.throttle(3, rate) if want else bed.unthrottle(3)
                    throttled = want
                (ctl / f"go-{name}").write_text("")
            while not (ctl / f"done-{name}").exists():
                if any(p.poll() not in (None, 0) for p in procs):
                    raise SystemExit("the bed job failed:\n" + "\n".join(p.communicate()[0][-800:] for p in procs))
                time.sleep(0.05)
        for p in procs:
            p.communicate(timeout=300)
    finally:
        bed.down()
    store = open_store(f"embedded://{tmp / 'store'}")
    r = Shipper(tmp / "spool", store).ship_all()
    print(f"bed job {job}: {len(spec)} scenarios, {r.segments} segments shipped in {r.passes} pass(es)")
    return store, job


def _named(findings: list) -> set[str]:
    return {str(f.evidence.get("link", f.kind)) for f in findings}


def report(store: object, job_id: str) -> None:
    m = compute_link_metrics(store, job_id)  # type: ignore[arg-type]
    r = GroupTestingDetector().detect(m)
    slow: dict[str, list[str]] = defaultdict(list)
    for i in np.flatnonzero(r.verdict == SLOW):
        g = m.groups[str(m.pg[i])]
        key = f"{g.name if g.is_p2p else 'ranks ' + ','.join(map(str, g.ranks))} {m.family[i]}"
        slow[key].append(f"w{int(m.window[i])} {float(r.ratio[i]):.1f}x {float(m.xfer_s[i]) * 1e3:.1f} ms")
    findings = find_slow_links(store, job_id)  # type: ignore[arg-type]
    names = [f"{f.kind} {f.evidence.get('link', '')} {f.evidence.get('slowdown')}x" for f in findings]
    # what the detector would say without its transient rule (a window as slow beside the link)
    bare = find_slow_links(store, job_id, detector=GroupTestingDetector(transient_k=0.0))  # type: ignore[arg-type]
    extra = sorted(_named(bare) - _named(findings))
    # ... and without its noise rule (slow tests no likelier than beside the link)
    loose = find_slow_links(store, job_id, detector=GroupTestingDetector(max_noise_p=1.0))  # type: ignore[arg-type]
    extra_noise = sorted(_named(loose) - _named(findings))
    print(
        f"{job_id}: {len(m)} cells, {int((r.verdict == SLOW).sum())} slow; findings: {names or 'none'}"
        + (f"; without the transient rule also: {extra}" if extra else "")
        + (f"; without the noise rule also: {extra_noise}" if extra_noise else "")
    )
    for key, cells in sorted(slow.items()):
        print(f"    {key}: {'; '.join(cells)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="h:10,h:10,h:10,h:10", help="kind:steps, comma-separated (h, t, s)")
    ap.add_argument("--rate", default="40mbit", help="tbf rate of the throttled scenarios")
    args = ap.parse_args()
    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"netbed_noise: {reason}")
    spec = []
    for i, part in enumerate(args.scenarios.split(",")):
        kind, steps = part.split(":")[:2]
        if kind not in ("h", "t", "s"):
            raise SystemExit(f"netbed_noise: unknown scenario kind {kind!r} (h, t or s)")
        spec.append((f"{kind}{i}", f"{steps}:5" if kind == "s" else steps))
    with tempfile.TemporaryDirectory(prefix="ranklens-netbed-noise-") as d:
        store, job = run_bed(spec, args.rate, Path(d))
        for name, _ in spec:
            report(store, f"{job}-{name}")


if __name__ == "__main__":
    main()
