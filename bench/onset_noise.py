"""How well a straggler's onset can be placed when the host is noisy: the detectors' run rule
(``_persistent_run``) on synthetic excess series — host noise (normal, or skewed like CPU
contention's bursts) plus a level shift at a known step — and the share of trials whose onset
is within 1, 2, 3 and 4 steps of the truth. The e2e tests' onset tolerances come from this
(tests/analyzers/test_cpu_starvation.py).

    python bench/onset_noise.py [--shift-ms 35] [--trials 3000]
"""

from __future__ import annotations

import argparse

import numpy as np

from ranklens.analyzers.detectors import _persistent_run


def trial(rng: np.random.Generator, sd: float, shift: float, dist: str, steps: int, onset: int) -> int | None:
    noise = rng.normal(0, sd, steps) if dist == "normal" else rng.exponential(sd, steps) - 0.7 * sd
    lv = noise / 1000
    lv[onset:] += shift / 1000
    hot = lv >= sd / 1000  # the peer detector's bar: one pooled noise deviation
    run = _persistent_run(hot, 0.7, 3, lv)
    return None if run is None or run[2] < 0 else run[0] - onset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shift-ms", type=float, default=35.0)
    ap.add_argument("--trials", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--onset", type=int, default=6)
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    print(f"shift {args.shift_ms:.0f} ms at step {args.onset} of {args.steps}, {args.trials} trials per row")
    print(f"{'noise sd':>9} {'dist':>7} {'found':>6} {'<=1':>6} {'<=2':>6} {'<=3':>6} {'<=4':>6} {'early>3':>8}")
    for sd in (10.0, 15.0, 20.0, 25.0):
        for dist in ("normal", "skewed"):
            errs = [trial(rng, sd, args.shift_ms, dist, args.steps, args.onset) for _ in range(args.trials)]
            e = np.array([x for x in errs if x is not None])
            within = " ".join(f"{np.mean(np.abs(e) <= k):6.3f}" for k in (1, 2, 3, 4))
            found = len(e) / len(errs)
            print(f"{sd:7.0f}ms {dist:>7} {found:6.2f} {within} {np.mean(e < -3):8.3f}")


if __name__ == "__main__":
    main()
