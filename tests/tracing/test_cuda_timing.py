"""The CUDA timing path behind its interface, with a stand-in for torch.cuda's event API.

The stand-in models what matters: a stream runs its events at device times the test controls;
``Event.query()`` is true only once the device has reached the event; ``elapsed_time`` is the device
time difference in milliseconds; ``synchronize()`` waits for the event. (Checked on a real GPU with
torch.cuda itself when one is available: see the closing notes.)
"""

from __future__ import annotations

from ranklens.tracing.timing import CudaEventTimer


class FakeDevice:
    """Device time runs independently of the host; events complete when device time passes them."""

    def __init__(self, host_offset_ns: int) -> None:
        self.now_ms = 0.0  # device clock
        self.host_offset_ns = host_offset_ns  # host time = device time + offset
        self.queue_ms = 0.0  # when the current stream will reach newly recorded work

    def host_ns(self) -> int:
        return int(self.now_ms * 1e6) + self.host_offset_ns


class FakeCuda:
    def __init__(self, dev: FakeDevice) -> None:
        self.dev = dev
        outer = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.at_ms: float | None = None

            def record(self, stream: object) -> None:
                self.at_ms = outer.dev.now_ms if stream == "side" else outer.dev.queue_ms

            def query(self) -> bool:
                return self.at_ms is not None and outer.dev.now_ms >= self.at_ms

            def synchronize(self) -> None:
                outer.dev.now_ms = max(outer.dev.now_ms, self.at_ms or 0.0)

            def elapsed_time(self, other: Event) -> float:
                assert self.query() and other.query(), "elapsed_time needs completed events"
                return other.at_ms - self.at_ms

        self.Event = Event

    def Stream(self) -> str:  # mirrors torch.cuda.Stream
        return "side"

    def current_stream(self) -> str:
        return "compute"


def test_events_map_to_host_time_without_waiting_on_the_training_thread():
    dev = FakeDevice(host_offset_ns=1_790_000_000_000_000_000)
    cuda = FakeCuda(dev)
    done = []
    timer = CudaEventTimer(cuda, lambda row, a, b, err: done.append((row["seq"], a, b, err)), clock=dev.host_ns)
    timer._thread = object()  # drive poll() by hand: no background thread in this test
    # the CPU enqueues a collective that the stream reaches at 5 ms and finishes at 7 ms
    dev.queue_ms = 5.0
    start = timer.begin()
    dev.queue_ms = 7.0
    timer.end(start, {"seq": 1})
    assert timer.poll() == 0 and done == []  # the device is still at 0 ms: nothing resolved, nothing waited
    dev.now_ms = 8.0
    assert timer.poll() == 1
    ((seq, enter, end, err),) = done
    assert seq == 1
    assert enter == dev.host_offset_ns + 5_000_000 and end == dev.host_offset_ns + 7_000_000
    assert err == 0  # the fake host clock does not move during the calibration window


def test_bounded_pending_and_close():
    dev = FakeDevice(0)
    timer = CudaEventTimer(FakeCuda(dev), lambda *a: None, clock=dev.host_ns, max_pending=2)
    timer._thread = object()
    for i in range(5):
        dev.queue_ms = 100.0 + i
        timer.end(timer.begin(), {"seq": i})
    assert timer.pending() == 2 and timer.dropped == 3
    dev.now_ms = 1000.0
    timer.close()
    assert timer.pending() == 0
