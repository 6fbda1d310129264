"""benchmarks/bench_server_load.py holds up over a long run on a shared machine (issue #56's load
run, session 46): the server's start window counts only the time the benchmark ran (session 45's
12-round int4 run failed to start, its server and the benchmark stopped by others' quiet locks past
a 300-second wall-clock deadline), and past it one line names --start-timeout; a client's own
failure is a request's outcome, not a crash that loses the rounds run; every round's load average
is recorded; the JSON is rewritten after every round and says why a run stopped early."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from benchmarks import bench_server_load as bench


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Proc:
    def __init__(self, code=None):
        self.code, self.killed = code, False

    def poll(self):
        return self.code

    def kill(self):
        self.killed = True


def test_pause_meter_leaves_out_a_stop():
    clock = Clock()
    meter = bench.PauseMeter(clock, every=1.0, gap=5.0)
    since, paused_then = meter.paused_until_now()
    for _ in range(3):
        clock.t += 1.0
        meter.tick()
    clock.t += 600.0                                     # stopped for 10 minutes
    assert meter.running(since, paused_then) == pytest.approx(4.0)     # before the ticker woke again
    meter.tick()
    clock.t += 1.0
    meter.tick()
    assert meter.paused == pytest.approx(599.0)
    assert meter.running(since, paused_then) == pytest.approx(5.0)
    clock.t += 3.0                                       # a slow wakeup under the gap is running time
    meter.tick()
    assert meter.running(since, paused_then) == pytest.approx(8.0)


def fake_waiting(answer_after: int, stop_at: int | None = None):
    """A meter on a fake clock, a probe that fails `answer_after` times (the clock jumping 1,000 s,
    a stop, at its `stop_at`th call), and a sleep that moves the clock and ticks the meter."""
    clock = Clock()
    meter = bench.PauseMeter(clock, every=0.2, gap=5.0)
    calls = []

    def probe():
        calls.append(clock.t)
        clock.t += 0.5
        if len(calls) == stop_at:
            clock.t += 1000.0
        if len(calls) <= answer_after:
            raise httpx.ConnectError("refused")

    def sleep(s):
        clock.t += s
        meter.tick()

    return meter, probe, sleep, calls


def test_the_start_window_leaves_out_the_time_the_benchmark_was_stopped():
    meter, probe, sleep, calls = fake_waiting(answer_after=10, stop_at=5)
    proc = Proc()
    ran = bench.wait_for_server(proc, "http://x", "int4", 30, meter, probe=probe, sleep=sleep)
    assert len(calls) == 11 and not proc.killed
    # 11 tries of 0.5 s and 10 sleeps of 0.2 s ran 7.5 s; the gap that held the 1,000 s stop (1,000.7 s
    # between two ticks) counts as paused less one tick: 1,007.5 - 1,000.5
    assert ran == pytest.approx(7.0)


def test_past_the_start_window_one_line_names_the_flag():
    meter, probe, sleep, calls = fake_waiting(answer_after=10 ** 6, stop_at=3)
    proc = Proc()
    with pytest.raises(bench.ServerDidNotStart) as e:
        bench.wait_for_server(proc, "http://x", "int4", 20, meter, probe=probe, sleep=sleep)
    assert proc.killed and 27 <= len(calls) <= 30                # 20 s of running at 0.7 s a try
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("the server for int4 did not answer within --start-timeout 20 s")
    assert msg.endswith("give a longer --start-timeout")


def test_a_server_that_exits_before_answering_is_named():
    meter, probe, sleep, calls = fake_waiting(answer_after=10 ** 6)
    with pytest.raises(bench.ServerDidNotStart, match=r"^the server for full exited with status 3 before answering"):
        bench.wait_for_server(Proc(code=3), "http://x", "full", 20, meter, probe=probe, sleep=sleep)
    assert len(calls) == 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_main_stops_with_the_flag_named_and_kills_the_server(tmp_path, monkeypatch, native_path):
    """A server that never answers (a process that only sleeps, on a port no one listens on):
    main ends with exit 1 and the one line, the process killed, the JSON saying why."""
    procs = []

    def spawn(model, label, window, streams):
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        return procs[0], f"http://127.0.0.1:{free_port()}"

    monkeypatch.setattr(bench, "spawn_server", spawn)
    out = tmp_path / "load.json"
    monkeypatch.setattr(sys, "argv", ["bench_server_load", str(native_path), "--start-timeout", "1.5",
                                      "--json", str(out)])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert str(e.value).startswith("bench_server_load: the server for full did not answer within --start-timeout 1.5 s")
    assert procs[0].wait(timeout=10) != 0
    saved = json.loads(out.read_text())
    assert saved["finished"] is False and "--start-timeout 1.5" in saved["stopped"] and saved["rounds"] == []


def test_a_client_failure_is_the_requests_outcome(monkeypatch):
    def timing_out(*a, **k):
        raise httpx.ReadTimeout("timed out")

    monkeypatch.setattr(bench.httpx, "stream", timing_out)
    assert bench.ask("http://x", "m", "p", 4, None, timeout=5) == "client error: ReadTimeout: timed out"


@pytest.mark.slow
def test_rounds_record_their_load_and_the_json_survives_the_server_dying(tmp_path, monkeypatch, native32_path):
    """Against a real server (the tests' tiny model, int4): each round records the load average at
    its start and end and its seconds; the JSON is written after round 0; the server killed during
    round 1 ends the run with exit 1, the round saying so and the JSON keeping round 0 whole (and
    holding it already during round 1, for a benchmark killed there)."""
    procs, calls, seen = [], [], []
    spawn, ask = bench.spawn_server, bench.ask
    out = tmp_path / "load.json"

    def spawning(*a):
        procs.append(spawn(*a))
        return procs[-1]

    def asking(*a):
        calls.append(a)
        if len(calls) == 5:                 # the first request of round 1 (4 a round)
            seen.append(json.loads(out.read_text()))     # what a benchmark killed here would have left
            procs[0][0].kill()
            procs[0][0].wait()
        return ask(*a)

    monkeypatch.setattr(bench, "spawn_server", spawning)
    monkeypatch.setattr(bench, "ask", asking)
    monkeypatch.setattr(sys, "argv", ["bench_server_load", str(native32_path), "--policy", "int4", "--rounds", "3",
                                      "--requests", "4", "--clients", "2", "--tokens", "4", "--json", str(out)])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 1
    saved = json.loads(out.read_text())
    assert saved["finished"] is False and saved["stopped"].startswith("the server exited with status -9 during round 1")
    assert len(saved["load_average_at_start"]) == 3 and len(saved["load_average_at_end"]) == 3
    assert seen[0]["finished"] is False and seen[0]["rounds"] == saved["rounds"][:1]
    first, second = saved["rounds"]
    assert sum(first["outcomes"].values()) == 4 and set(first["outcomes"]) <= {"complete", "cancelled"}
    assert first["server_rss_mib"] > 0 and "compiled" in first
    for row in saved["rounds"]:
        assert len(row["load_average_at_start"]) == 3 and len(row["load_average_at_end"]) == 3
        assert row["seconds"] >= 0 and row["paused_seconds"] >= 0
    assert second["server_exited"] == -9 and "server_rss_mib" not in second
    assert all(k.startswith("client error") for k in second["outcomes"])


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (/proc)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    """A process `pid` still there and not a zombie (a child not yet reaped is gone for this test)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_server_and_the_json_says_why(tmp_path, native32_path, sig):
    """The benchmark in its own process against a real server (the tests' tiny model, int4), sent
    SIGTERM (`kill`) or SIGINT (Ctrl-C) once rounds 0 and 1 are in the JSON: it ends within a minute
    with exit 1 and one line naming the signal, its server process gone (stopped, not left running),
    and the JSON keeping the rounds it held, `finished` false and `stopped` naming the signal and the
    round.

    The signal lands in one of two states, both asserted exactly: during round k before its row is
    appended to the rounds (k kept), or in the window after that and before round k+1 sets `where`
    (k+1 kept, saved then or by the clean-up, the stop still named "round k"). Sent once only round
    0 was saved (session 47), it could land in that window after round 0 and read "during round 0",
    failing `k >= 1` (shown by a sleep injected there in a copy); once round 1 is saved, k >= 1 in
    either state, whatever the moment."""
    import os
    import signal
    import time

    out = tmp_path / "load.json"
    bench_proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_server_load", str(native32_path),
                                   "--policy", "int4", "--rounds", "1000", "--requests", "8", "--clients", "4",
                                   "--tokens", "48", "--json", str(out)],
                                  cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
    server = None
    try:
        deadline, seen = time.time() + 300, []
        while len(seen) < 2:                           # rounds 0 and 1 saved (the JSON is written whole)
            assert bench_proc.poll() is None and time.time() < deadline, bench_proc.communicate(timeout=60)
            time.sleep(0.1)
            seen = json.loads(out.read_text())["rounds"] if out.exists() else []
        (server,) = _children(bench_proc.pid)          # the server process, the benchmark's one child
        assert _alive(server)
        bench_proc.send_signal(getattr(signal, sig))
        stdout, stderr = bench_proc.communicate(timeout=120)
    finally:
        if bench_proc.poll() is None:
            bench_proc.kill()
            bench_proc.wait()
        if server is not None and _alive(server):       # (left running: the test fails, the process does not stay)
            os.kill(server, signal.SIGKILL)
            time.sleep(0.5)
            assert False, f"the server process {server} was left running after {sig}"
    assert bench_proc.returncode == 1
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(f"bench_server_load: {sig} received during round "), stderr
    saved = json.loads(out.read_text())
    assert saved["server_pid"] == server
    assert saved["finished"] is False and saved["stopped"].startswith(f"{sig} received during round ")
    k, kept = int(saved["stopped"].split("round ")[1]), len(saved["rounds"])
    assert saved["rounds"][:len(seen)] == seen and kept >= len(seen) >= 2      # the rounds seen, kept whole
    # during round k (k kept), or after round k was kept and before round k+1 began (k+1 kept)
    assert kept in (k, k + 1) and k >= 1, (k, kept)
    assert [r["round"] for r in saved["rounds"]] == list(range(kept))
    assert line.endswith(f"{kept} round(s) kept in {out}")
    assert all(set(r["outcomes"]) <= {"complete", "cancelled"} for r in saved["rounds"])
    assert len(saved["load_average_at_end"]) == 3
