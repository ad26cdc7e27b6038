"""--threads and the thread policy: one count for every parallel region, the CPU worker's default, and decode steps
that adapt their count when another program takes a core (the policy is driven by a simulated clock here; the
figures of a real shared machine are benchmarks/contention.py's)."""
from __future__ import annotations

import pytest
import torch

from dsv3lite import threads
from dsv3lite.cli import main
from dsv3lite.errors import UserError


class Machine:
    """A decode step's seconds for each thread count, and a clock the steps advance."""

    def __init__(self, seconds: dict[int, float]):
        self.seconds, self.now = dict(seconds), 0.0

    def clock(self) -> float:
        return self.now

    def decode(self, policy: threads.ThreadPolicy, steps: int, cap=None) -> list[int]:
        used = []
        for _ in range(steps):
            with policy.step(cap) as n:
                self.now += self.seconds[n]
            used.append(n)
        return used


def test_candidates_cover_one_core_taken_and_halving():
    assert threads.candidates(1) == [1]
    assert threads.candidates(2) == [2, 1]
    assert threads.candidates(16) == [16, 15, 7, 3, 1]


def test_adaptive_policy_keeps_every_thread_on_a_quiet_machine(one_thread):
    m = Machine({2: 1e-3, 1: 1.7e-3})
    p = threads.ThreadPolicy(2, clock=m.clock)
    used = m.decode(p, 2000)
    assert p.chosen == 2 and used[-1] == 2
    assert used.count(1) < 0.02 * len(used)                 # the other count is measured seldom


def test_adaptive_policy_drops_a_thread_when_a_core_is_taken_and_comes_back(one_thread):
    m = Machine({2: 1e-3, 1: 1.7e-3})
    p = threads.ThreadPolicy(2, clock=m.clock)
    m.decode(p, 500)
    assert p.chosen == 2
    m.seconds[2] = 40e-3                                      # another program spins on one of the two cores
    used = m.decode(p, 200)
    assert p.chosen == 1 and used[-150:] == [1] * 150         # noticed within a few steps
    assert used.count(2) <= 6
    busy = Machine({2: 40e-3, 1: 1.7e-3})
    busy.now = m.now
    p.clock = busy.clock
    used = busy.decode(p, 20000)                              # ~35 s busy: the slow count is tried rarely
    assert used.count(2) * 40e-3 < 0.05 * busy.now
    busy.seconds[2] = 1e-3                                    # the other program ends
    used = busy.decode(p, 40000)
    assert p.chosen == 2 and used[-30000:].count(1) < 0.01 * 30000   # back within seconds


def test_a_new_reply_measures_afresh(one_thread):
    m = Machine({2: 40e-3, 1: 20e-3})                         # busy: one thread is faster
    p = threads.ThreadPolicy(2, clock=m.clock)
    m.decode(p, 200)
    assert p.chosen == 1
    m.seconds[2] = 10e-3                                      # the other program ended while nothing decoded
    m.now += 5.0
    used = m.decode(p, 12)
    assert p.chosen == 2 and used[-2:] == [2, 2]              # the next reply is back on both cores at once


def test_a_reply_that_finds_a_core_taken_pays_three_slow_steps(one_thread):
    m = Machine({2: 1e-3, 1: 1.7e-3})
    p = threads.ThreadPolicy(2, clock=m.clock)
    m.decode(p, 300)
    assert p.chosen == 2
    m.seconds[2], m.now = 40e-3, m.now + 5.0                  # between replies, another program took a core
    used = m.decode(p, 40)
    assert p.chosen == 1 and used.count(2) == 3 and used[3:] == [1] * 37


def test_a_lone_thread_that_starts_on_the_busy_core_is_still_chosen(one_thread):
    """The first steps of a lone thread can run on the busy core until the scheduler moves it: its figure is its
    fastest step, so those first slow steps do not keep two threads on a busy machine."""
    class Moving(Machine):
        def decode(self, policy, steps, cap=None):
            used = []
            for _ in range(steps):
                with policy.step(cap) as n:
                    ones = used.count(1)
                    self.now += self.seconds[n] * (3 if n == 1 and ones < 4 else 1)    # moved after 4 steps
                used.append(n)
            return used

    m = Moving({2: 2.5e-3, 1: 1e-3})
    p = threads.ThreadPolicy(2, clock=m.clock)
    used = m.decode(p, 60)
    assert p.chosen == 1 and used[-40:] == [1] * 40


def test_a_lucky_step_of_two_threads_on_a_busy_core_does_not_win(one_thread):
    """Now and then a step of two threads falls where the other program was off its core and runs at quiet speed:
    several threads are judged by their median step, and the fewest threads within FEWER of the best are kept."""
    class Lucky(Machine):
        def decode(self, policy, steps, cap=None):
            used = []
            for i in range(steps):
                with policy.step(cap) as n:
                    self.now += self.seconds[n] if n == 1 or i % 5 else 0.9e-3          # one lucky step in 5
                used.append(n)
            return used

    m = Lucky({2: 4e-3, 1: 1e-3})
    p = threads.ThreadPolicy(2, clock=m.clock)
    used = m.decode(p, 400)
    assert p.chosen == 1 and used[-300:].count(2) < 10
    close = Machine({2: 1.0e-3, 1: 1.05e-3})                  # within FEWER of each other: one thread is kept
    q = threads.ThreadPolicy(2, clock=close.clock)
    close.decode(q, 50)
    assert q.chosen == 1


def test_fixed_policy_and_the_tiny_model_cap(one_thread):
    m = Machine({1: 1e-3, 2: 9.0, 3: 9.0})
    assert set(m.decode(threads.ThreadPolicy(3, adaptive=False, clock=m.clock), 50, cap=1)) == {1}
    m = Machine({1: 9.0, 2: 9.0, 3: 1e-3})
    assert set(m.decode(threads.ThreadPolicy(3, adaptive=False, clock=m.clock), 50)) == {3}


def test_a_step_runs_with_its_count_and_restores_torchs(one_thread):
    p = threads.ThreadPolicy(2, adaptive=False)
    with p.step() as n:
        assert n == 2 and torch.get_num_threads() == 2
    assert torch.get_num_threads() == 1
    with p.step(cap=1):
        assert torch.get_num_threads() == 1


def test_resolve_and_physical_cores():
    assert threads.resolve(3) == 3 and threads.resolve(None) == threads.physical_cores() >= 1
    for bad in (0, -2, 1.5, True, "4"):
        with pytest.raises(UserError):
            threads.resolve(bad)
    assert threads.worker_threads(1) == 1 and threads.worker_threads(8) == 7


def test_threads_flag_reaches_every_parallel_region(capsys, monkeypatch, v3_dir, one_thread):
    from dsv3lite import builder
    from dsv3lite.generate import Engine

    seen = {}
    real = Engine.__init__

    def spy(self, *a, **kw):
        real(self, *a, **kw)
        seen.update(policy=self.threads, torch=torch.get_num_threads())
    monkeypatch.setattr(Engine, "__init__", spy)
    try:
        assert main(["generate", "-w", str(v3_dir), "-p", "hi", "-m", "2", "-t", "3"]) == 0
        assert seen["torch"] == 3 and seen["policy"].limit == 3 and not seen["policy"].adaptive
        assert main(["generate", "-w", str(v3_dir), "-p", "hi", "-m", "2"]) == 0
        assert seen["torch"] == threads.physical_cores() and seen["policy"].adaptive
        assert main(["generate", "-w", str(v3_dir), "-p", "hi", "-m", "2", "--threads", "0"]) != 0
    finally:
        torch.set_num_threads(1)
    assert "--threads" in capsys.readouterr().err
    assert builder.thread_policy_for(None, torch.device("cuda")).adaptive is False   # GPU steps: no adapting


@pytest.mark.parametrize("command", ["chat", "generate", "serve", "ui", "trace", "quantize"])
def test_every_computing_command_has_threads(capsys, command):
    assert main([command, "--help"]) == 0
    assert "--threads" in capsys.readouterr().out


def test_cpu_worker_leaves_the_main_thread_a_core(one_thread):
    from dsv3lite.offload.cpu_worker import CpuWorker

    class Host:
        layers = {1: torch.zeros(4, 8, dtype=torch.uint8)}

    torch.set_num_threads(4)
    try:
        assert CpuWorker(Host(), None).threads == 3
        assert CpuWorker(Host(), None, threads=2).threads == 2
    finally:
        torch.set_num_threads(1)
