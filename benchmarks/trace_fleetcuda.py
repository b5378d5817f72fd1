#!/usr/bin/env python3
"""Where one `fleetcuda` run spends its wall time: a timeline, without changing fleetcuda.

    .venv/bin/python benchmarks/trace_fleetcuda.py [--forks N] [--channels N] -- verify RECIPE -i INV --plain

Runs fleetcuda's own main() in this process, with timing wrappers around its phases (imports,
loading and planning, each host's SSH connect, each target's channel: open, exec, first byte,
end) and prints them, in ms since this process started (kernel start time), to stderr as JSON
lines plus a SUMMARY line. --channels overrides fleetcuda.connectors.ssh.CHANNELS_PER_HOST (default 8) for
the experiment; --forks is fleetcuda's own option. Nothing of fleetcuda's code is edited.
"""

from __future__ import annotations

import os
import time

T0 = time.monotonic()  # first thing: before any import of ours


def _process_start_monotonic() -> float:
    """This process's start, on the monotonic clock (from /proc: clock ticks after boot)."""
    ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
    uptime = float(open("/proc/uptime").read().split()[0])
    return time.monotonic() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


START = _process_start_monotonic()

import json  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

EVENTS: list[dict] = []
LOCK = threading.Lock()


def ev(what: str, **kw: object) -> None:
    with LOCK:
        EVENTS.append({"ms": round((time.monotonic() - START) * 1000, 1), "what": what,
                       "thread": threading.current_thread().name, **kw})


def main() -> int:
    opts, argv = sys.argv[1:], []
    if "--" in opts:
        i = opts.index("--")
        opts, argv = opts[:i], opts[i + 1:]
    channels = int(opts[opts.index("--channels") + 1]) if "--channels" in opts else None
    if "--forks" in opts:
        argv += ["--forks", opts[opts.index("--forks") + 1]]
    ev("python-started-our-code", interpreter_startup_ms=round((T0 - START) * 1000, 1))
    import fleetcuda.cli as cli
    import fleetcuda.connectors.ssh as transport
    import fleetcuda.run.engine as engine
    ev("imports-done")
    if channels is not None:
        transport.CHANNELS_PER_HOST = channels

    orig_connect = transport.SshTransport._connect

    def _connect(self):  # type: ignore[no-untyped-def]
        ev("connect-start", host=self.hop.address)
        try:
            return orig_connect(self)
        finally:
            ev("connect-end", host=self.hop.address)

    transport.SshTransport._connect = _connect

    orig_open = transport.SshTransport._open

    def _open(self):  # type: ignore[no-untyped-def]
        ev("wait-connection", host=self.hop.address)
        t = orig_open(self)
        ev("have-connection", host=self.hop.address)
        return t

    transport.SshTransport._open = _open

    orig_drain = transport.SshTransport._drain

    def _drain(self, chan, remote, start, timeout, on_line):  # type: ignore[no-untyped-def]
        ev("channel-open", host=self.hop.address)
        first = []

        def line(text: str) -> None:
            if not first:
                first.append(1)
                ev("first-output", host=self.hop.address)
            on_line(text)

        try:
            return orig_drain(self, chan, remote, start, timeout, line)
        finally:
            ev("channel-done", host=self.hop.address)

    transport.SshTransport._drain = _drain

    orig_run_target = engine.Engine._run_target

    def _run_target(self, target, result):  # type: ignore[no-untyped-def]
        ev("target-start", target=target.id)
        try:
            return orig_run_target(self, target, result)
        finally:
            ev("target-end", target=target.id)

    engine.Engine._run_target = _run_target

    orig_engine_run = engine.Engine.run

    def _engine_run(self):  # type: ignore[no-untyped-def]
        ev("engine-start", forks=self.forks, channels=transport.CHANNELS_PER_HOST)
        try:
            return orig_engine_run(self)
        finally:
            ev("engine-end")

    engine.Engine.run = _engine_run

    rc = cli.main(argv)  # its report goes to stdout as usual; the timeline to stderr
    ev("main-returned", rc=rc)
    for e in EVENTS:
        print(json.dumps(e), file=sys.stderr)
    summary(rc)
    return rc


def summary(rc: int) -> None:
    def first(what: str) -> float:
        return min(e["ms"] for e in EVENTS if e["what"] == what)

    def last(what: str) -> float:
        return max(e["ms"] for e in EVENTS if e["what"] == what)

    conns = [(e["host"], e["ms"]) for e in EVENTS if e["what"] in ("connect-start", "connect-end")]
    per_host: dict[str, list[float]] = {}
    for host, ms in conns:
        per_host.setdefault(host, []).append(ms)
    chans = {}
    for e in EVENTS:
        if e["what"] in ("channel-open", "channel-done"):
            chans.setdefault(e["thread"], []).append(e["ms"])
    durations = sorted(b - a for v in chans.values() for a, b in zip(v[0::2], v[1::2], strict=False))
    out = {
        "rc": rc,
        "interpreter_startup_ms": EVENTS[0]["interpreter_startup_ms"],
        "until_imports_done_ms": first("imports-done"),
        "load_and_plan_ms": round(first("engine-start") - first("imports-done"), 1),
        "engine_start_ms": first("engine-start"),
        "connect_ms_per_host": {h: round(v[1] - v[0], 1) for h, v in per_host.items() if len(v) == 2},
        "first_channel_open_ms": first("channel-open"),
        "last_channel_done_ms": last("channel-done"),
        "engine_end_ms": last("engine-end"),
        "main_returned_ms": last("main-returned"),
        "after_engine_ms": round(last("main-returned") - last("engine-end"), 1),
        "channel_ms_min_median_max": [round(durations[0]), round(durations[len(durations) // 2]),
                                      round(durations[-1])] if durations else None,
    }
    print("SUMMARY " + json.dumps(out), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
