"""Where the suite's time goes: each test's wall time and the CPU it used.

A test's CPU is its worker's own (user + system), that of the subprocesses it waited for
(torchrun, the CLI), and that of the ranks its ``run_ranks`` calls ran on (which are the
rank server's children, invisible to this process's rusage and to ``time`` of the whole
run: see ``zeroshard.testing.rank_cpu_seconds``; likewise the ranks an in-process
``zeroshard bench``/``train`` forks, ``zeroshard.launch.rank_cpu_seconds``). Setup and teardown count, so a
module-scoped fixture's cost lands on the first test that asks for it.

At the end of a run (on the controller when pytest-xdist runs workers) this writes
``.pytest-times.json`` at the repository root (every test: wall, CPU, idle = wall - CPU) and
prints the ten tests that waited longest and every test over the budget
(``ZEROSHARD_TEST_BUDGET_S``, 60 s by default; README, "Tests"), with the cores' busy
share over the run read from /proc/stat (the whole machine's: meaningful on a quiet one).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

BUDGET_S = float(os.environ.get("ZEROSHARD_TEST_BUDGET_S", "60"))
_OUT = Path(__file__).resolve().parent.parent / ".pytest-times.json"
_KEY = "zeroshard_cpu_s"
_TOP = 10


def _cpu_now() -> float:
    t = os.times()
    ranks = sys.modules.get("zeroshard.testing.supervise")  # imported once a call ran
    rank_cpu = ranks.rank_cpu_seconds() if ranks is not None else 0.0
    launch = sys.modules.get("zeroshard.launch")  # `zeroshard bench`/`train` run in-process
    rank_cpu += launch.rank_cpu_seconds() if launch is not None else 0.0
    return t.user + t.system + t.children_user + t.children_system + rank_cpu


def _machine_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores since boot, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


class TimingPlugin:
    def __init__(self, worker: bool) -> None:
        self.worker = worker  # an xdist worker measures; the controller reports
        self.tests: dict[str, dict[str, Any]] = {}
        self.started = time.monotonic()
        self.ticks = _machine_ticks()

    # -- on the process that runs the test (a worker under xdist) ------------------------
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        yield from self._measure(item, "setup")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        yield from self._measure(item, "call")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item):
        yield from self._measure(item, "teardown")

    def _measure(self, item: pytest.Item, when: str):
        start = _cpu_now()
        yield
        item.stash.setdefault(_STASH, {})[when] = _cpu_now() - start

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        outcome = yield
        cpu = item.stash.get(_STASH, {}).get(call.when)
        if cpu is not None:  # travels to xdist's controller with the report
            outcome.get_result().user_properties.append((_KEY, cpu))

    # -- on the controller ---------------------------------------------------------------
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.worker:
            return
        t = self.tests.setdefault(report.nodeid, {"wall_s": 0.0, "cpu_s": 0.0})
        t["wall_s"] += report.duration
        t["cpu_s"] += dict(report.user_properties).get(_KEY, 0.0)
        # When each worker finished its last test: a worker done long before the other
        # is a tail of one idle core (xdist hands out whole files).
        node = getattr(report, "node", None)
        worker = getattr(getattr(node, "gateway", None), "id", "main")
        t["worker"], t["end_s"] = worker, time.monotonic() - self.started

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.worker or not self.tests:
            return
        for t in self.tests.values():
            t["idle_s"] = max(0.0, t["wall_s"] - t["cpu_s"])
        wall = time.monotonic() - self.started
        summary = {"wall_s": wall, "tests": len(self.tests),
                   "test_wall_s": sum(t["wall_s"] for t in self.tests.values()),
                   "test_cpu_s": sum(t["cpu_s"] for t in self.tests.values()),
                   "cores": os.cpu_count(), "budget_s": BUDGET_S}
        ends: dict[str, float] = {}
        for t in self.tests.values():
            ends[t["worker"]] = max(ends.get(t["worker"], 0.0), t["end_s"])
        summary["workers_done_s"] = dict(sorted(ends.items()))
        now = _machine_ticks()
        if self.ticks is not None and now is not None and now[1] > self.ticks[1]:
            summary["machine_busy"] = (now[0] - self.ticks[0]) / (now[1] - self.ticks[1])
        rows = sorted(self.tests.items(), key=lambda kv: -kv[1]["idle_s"])
        _OUT.write_text(json.dumps({"summary": summary, "tests": dict(rows)}, indent=1))
        tr = terminalreporter
        tr.section("where the time went (.pytest-times.json)")
        busy = summary.get("machine_busy")
        tr.write_line(
            f"{summary['tests']} tests, {wall:.0f} s wall; tests' CPU {summary['test_cpu_s']:.0f} s"
            f" on {summary['cores']} cores"
            + (f"; cores busy {busy:.0%} of the run (whole machine)" if busy is not None else ""))
        if len(ends) > 1:
            tr.write_line("workers done at " + ", ".join(
                f"{w} {s:.0f} s" for w, s in summary["workers_done_s"].items()))
        tr.write_line(f"longest waits (wall - CPU), top {_TOP}:")
        for nodeid, t in rows[:_TOP]:
            tr.write_line(f"  {t['idle_s']:6.1f} s idle  {t['wall_s']:6.1f} s wall  "
                          f"{t['cpu_s']:6.1f} s CPU  {nodeid}")
        over = sorted(((t["wall_s"], n) for n, t in self.tests.items() if t["wall_s"] > BUDGET_S),
                      reverse=True)
        if over:
            tr.write_line(f"over the {BUDGET_S:g} s budget per test (README, 'Tests'):",
                          red=True)
            for w, nodeid in over:
                tr.write_line(f"  {w:6.1f} s  {nodeid}", red=True)
        else:
            tr.write_line(f"no test over the {BUDGET_S:g} s budget per test")


_STASH = pytest.StashKey[dict]()
