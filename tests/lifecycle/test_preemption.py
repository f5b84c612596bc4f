"""``bert_ds.lifecycle.preemption.Preemption``: building one changes nothing; :meth:`arm` installs the handlers, takes
over a signal caught while importing and starts the runner watch; :meth:`disarm` ignores the signals. The runner watch
is tried on a real process tree: a "runner" whose child carries DeepSpeed's launch module name in its command line,
SIGKILLed while its grandchild waits armed. The whole path with real ranks:
``tests/faults/test_fault_table_preemption.py``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest

from bert_ds.exit_codes import ExitCode
from bert_ds.lifecycle import early_signals
from bert_ds.lifecycle.preemption import PREEMPTION_SIGNALS, Preemption
from tests.helpers import HANG_GUARD_S, child_env


@pytest.fixture
def handlers():
    """Put back this process's handlers and the class's and early_signals' records after the test."""
    saved = {sig: signal.getsignal(sig) for sig in PREEMPTION_SIGNALS}
    last, caught = Preemption.last_signal, list(early_signals._caught)
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    Preemption.last_signal = last
    early_signals._caught[:] = caught


def test_building_one_installs_nothing_and_starts_no_thread(handlers):
    before = {sig: signal.getsignal(sig) for sig in PREEMPTION_SIGNALS}
    threads = set(threading.enumerate())
    preemption = Preemption()
    assert {sig: signal.getsignal(sig) for sig in PREEMPTION_SIGNALS} == before
    assert set(threading.enumerate()) == threads
    assert not preemption.requested and not preemption.while_importing


@pytest.mark.parametrize("sig", PREEMPTION_SIGNALS)
def test_an_armed_one_turns_the_signal_into_a_request(sig, handlers):
    preemption = Preemption().arm()
    assert not preemption.requested
    os.kill(os.getpid(), sig)  # delivered to the main thread before the next bytecode
    assert preemption.requested and Preemption.last_signal == sig


def test_a_signal_caught_while_importing_is_a_request_once_armed(handlers, capsys):
    early_signals.catch()
    os.kill(os.getpid(), signal.SIGTERM)
    assert early_signals.caught() == signal.SIGTERM
    preemption = Preemption().arm()
    assert preemption.requested and preemption.while_importing
    assert preemption.stopped_during_startup("before joining the process group", None) == ExitCode.PREEMPTED == 75
    assert capsys.readouterr().out == ("pre-empted before joining the process group (SIGTERM while the rank was still "
                                       "importing): nothing trained or written since the start; exit 75\n")


def test_disarmed_the_signals_are_ignored(handlers):
    Preemption().arm().disarm()
    assert all(signal.getsignal(sig) is signal.SIG_IGN for sig in PREEMPTION_SIGNALS)


RANK = textwrap.dedent("""
    import time
    from bert_ds.lifecycle.preemption import Preemption
    preemption = Preemption().arm()
    print("armed", flush=True)
    deadline = time.monotonic() + 60
    while not preemption.requested and time.monotonic() < deadline:
        time.sleep(0.05)
    print("requested" if preemption.requested else "not requested", Preemption.last_signal, flush=True)
""")
LAUNCH = "import os, subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', os.environ['RANK_CODE']]))"
RUNNER = textwrap.dedent("""
    import subprocess, sys, time
    from bert_ds.deepspeed_internals import LAUNCH_MODULE
    subprocess.Popen([sys.executable, "-c", sys.argv[1], LAUNCH_MODULE])  # what runner.py starts: launch.py
    time.sleep(600)
""")


def test_the_runner_gone_is_a_sigterm_to_the_rank():
    """DeepSpeed's runner SIGKILLed (no signal reaches the ranks): the rank polls it and asks for a pre-emption."""
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, LAUNCH], stdout=subprocess.PIPE, text=True,
                              env=child_env(RANK_CODE=RANK))
    tree: list[psutil.Process] = []
    try:
        assert runner.stdout.readline().strip() == "armed"
        tree = psutil.Process(runner.pid).children(recursive=True)
        assert len(tree) == 2  # launch.py's stand-in and the rank
        runner.kill()
        runner.wait(timeout=HANG_GUARD_S)
        assert runner.stdout.readline().split() == ["requested", str(int(signal.SIGTERM))]
        psutil.wait_procs(tree, timeout=HANG_GUARD_S)
    finally:
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        if runner.poll() is None:
            runner.kill()
            runner.wait()
