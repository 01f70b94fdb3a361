"""The load progress line of kt.hf and the vLLM plugin (kt._progress):
shown only where asked or on a terminal, what it says, and its arithmetic."""
import io

import pytest

from kt._progress import LoadProgress, wanted


class Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("enabled,env,tty,shown", [
    (None, None, True, True), (None, None, False, False),
    (None, "0", True, False), (None, "1", False, True),
    (True, "0", False, True), (False, "1", True, False),
])
def test_shown_only_where_asked_or_on_a_terminal(monkeypatch, enabled, env, tty, shown):
    if env is None:
        monkeypatch.delenv("KT_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("KT_PROGRESS", env)
    stream = Stream(tty)
    assert wanted(enabled, stream) is shown
    p = LoadProgress("load", 2, 2000, enabled=enabled, stream=stream)
    p.update(0.5)
    p.layer_done(1000)
    p.layer_done(1000)
    p.close()
    assert bool(stream.getvalue()) is shown


def test_layers_bytes_rate_and_time_left():
    clock, stream = Clock(), Stream(False)
    p = LoadProgress("kt: experts from /m", 4, 4_000_000_000, enabled=True, stream=stream, clock=clock,
                     interval=0.0)
    clock.now += 2.0
    p.layer_done(1_000_000_000)  # 1 GB in 2 s: 0.5 GB/s, 3 GB left -> 6 s
    assert p.line() == "kt: experts from /m: layer 1/4, 1.0 GB of 4.0 GB, 500.0 MB/s, 6s left"
    clock.now += 1.0
    p.update(0.5)  # half of the next layer: 1.5 GB in 3 s
    assert p.line() == "kt: experts from /m: layer 1/4, 1.5 GB of 4.0 GB, 500.0 MB/s, 5s left"
    for _ in range(3):
        clock.now += 119.0
        p.layer_done(1_000_000_000)
    p.close()
    lines = stream.getvalue().splitlines()
    # Not a terminal: one line per redraw, no carriage returns; the last says the total time.
    assert "\r" not in stream.getvalue() and len(lines) == 5
    assert lines[-1] == "kt: experts from /m: layer 4/4, 4.0 GB of 4.0 GB, 11.1 MB/s, in 6m00s"


def test_a_terminal_gets_one_line_redrawn_in_place():
    clock, stream = Clock(), Stream(True)
    p = LoadProgress("load", 2, 2_000_000, stream=stream, clock=clock, interval=1.0)
    clock.now += 0.5
    p.layer_done(1_000_000)
    clock.now += 0.1
    p.update(0.5)  # within the interval: not redrawn
    clock.now += 0.4
    p.layer_done(1_000_000)  # the last layer is always drawn
    p.close()
    out = stream.getvalue()
    assert out.count("\r\x1b[K") == 3 and out.endswith("\n") and out.count("\n") == 1, repr(out)
    assert out.rsplit("\r\x1b[K", 1)[1] == "load: layer 2/2, 2.0 MB of 2.0 MB, 2.0 MB/s, in 1s\n"
