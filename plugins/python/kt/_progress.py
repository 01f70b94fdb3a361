"""A progress line for whole-model loads (kt.hf, the vLLM plugin): layers and
bytes done, the rate and the time left, rewritten in place on stderr.

Shown when asked (``enabled=True``), never when ``enabled=False``; with
``enabled=None`` (the default of its users) only when the stream is a
terminal, so logs and pipes get nothing. $KT_PROGRESS=0 turns the default
off (quiet), $KT_PROGRESS=1 turns it on for a stream that is no terminal.
"""
import os
import sys
import time


def _bytes_text(n):
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return ("%.0f %s" if unit == "B" else "%.1f %s") % (n, unit)
        n /= 1000.0
    return "%.1f GB" % n


def _seconds_text(s):
    s = int(round(s))
    return "%dm%02ds" % (s // 60, s % 60) if s >= 60 else "%ds" % s


def wanted(enabled, stream):
    """Whether a progress line goes to stream: enabled as given, else
    $KT_PROGRESS, else whether the stream is a terminal."""
    if enabled is not None:
        return bool(enabled)
    env = os.environ.get("KT_PROGRESS", "").strip()
    if env in ("0", "1"):
        return env == "1"
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class LoadProgress:
    """Counts layers and bytes of a load of ``total_layers`` layers holding
    ``total_bytes``; ``update`` within a layer, ``layer_done`` after it,
    ``close`` at the end (a final line with the totals). Redraws at most
    every ``interval`` seconds; costs a clock read per call when shown and
    nothing when not."""

    def __init__(self, what, total_layers, total_bytes, *, enabled=None, stream=None, interval=0.2,
                 clock=time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        self.shown = wanted(enabled, self.stream)
        isatty = getattr(self.stream, "isatty", None)
        self._tty = bool(isatty and isatty())
        self.what, self.total_layers, self.total_bytes = what, int(total_layers), int(total_bytes)
        self.layers, self.bytes = 0, 0
        self._partial = 0  # bytes of the layer in progress
        self._clock, self._interval = clock, interval
        self._start = clock()
        self._drawn = None
        self._closed = False

    def update(self, layer_fraction):
        """The layer in progress is this fraction (0..1) done."""
        if not self.shown or self.total_layers <= self.layers:
            return
        per_layer = (self.total_bytes - self.bytes) / max(1, self.total_layers - self.layers)
        self._partial = int(per_layer * min(max(layer_fraction, 0.0), 1.0))
        self._draw()

    def layer_done(self, nbytes):
        self.layers += 1
        self.bytes += int(nbytes)
        self._partial = 0
        self._draw(force=self.layers == self.total_layers)

    def line(self):
        """The text of the progress line as of now."""
        elapsed = max(self._clock() - self._start, 1e-9)
        done = self.bytes + self._partial
        rate = done / elapsed
        text = "%s: layer %d/%d, %s of %s, %s/s" % (self.what, self.layers, self.total_layers, _bytes_text(done),
                                                   _bytes_text(self.total_bytes), _bytes_text(rate))
        if self.layers < self.total_layers and rate > 0:
            text += ", %s left" % _seconds_text((self.total_bytes - done) / rate)
        else:
            text += ", in %s" % _seconds_text(elapsed)
        return text

    def _draw(self, force=False):
        if not self.shown or self._closed:
            return
        now = self._clock()
        if not force and self._drawn is not None and now - self._drawn < self._interval:
            return
        self._drawn = now
        # A terminal gets one line redrawn in place, a log one line per redraw.
        self.stream.write("\r\x1b[K" + self.line() if self._tty else self.line() + "\n")
        self.stream.flush()

    def close(self):
        if self._closed:
            return
        if self.shown and self.layers:
            if self._drawn is None or self.layers < self.total_layers or self._tty:
                self._draw(force=True)
            if self._tty:
                self.stream.write("\n")
            self.stream.flush()
        self._closed = True
