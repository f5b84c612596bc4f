"""The restart policy of both supervisors (``bert_ds.lifecycle.restart``) without rank trees: which codes restart,
the backoff, the lines and records, the resources released between attempts (a real listening socket, real
``/dev/shm`` files), and the loop itself around attempts that are plain functions. With real ranks:
``tests/lifecycle/test_restart_ranks.py``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from bert_ds import exit_codes
from bert_ds.exit_codes import ExitCode
from bert_ds.lifecycle import restart
from tests.helpers import HANG_GUARD_S
from tests.helpers.shm import MAP_AND_WAIT


@pytest.mark.parametrize(("code", "restarted"), [
    (1, True), (124, True), (137, True), (134, True), (143, True), (139, True),
    (0, False), (2, False), (3, False), (74, False), (75, False), (127, False), (200, False),
])
def test_which_codes_restart(code, restarted):
    assert restart.retryable(code) is restarted
    assert (restart.why_not_restarted(code) is None) is restarted


def test_never_restarted_says_why_and_a_signalled_supervisor_never_restarts():
    assert "repeat" in restart.why_not_restarted(2) and "repeat" in restart.why_not_restarted(3)
    assert "disk" in restart.why_not_restarted(74) and "pre-empted" in restart.why_not_restarted(75)
    assert "signalled" in restart.why_not_restarted(137, preempted=True)


def test_signal_deaths_are_128_plus_the_signal():
    assert exit_codes.signal_exit_code(signal.SIGKILL) == 137
    assert exit_codes.from_negated_signal(256 - signal.SIGKILL) == 137  # DeepSpeed's launch.py: sys.exit(-9) -> 247
    assert exit_codes.from_negated_signal(256 - signal.SIGABRT) == 134
    assert [exit_codes.from_negated_signal(c) for c in (0, 1, 2, 74, 75, 124)] == [0, 1, 2, 74, 75, 124]
    assert (exit_codes.signal_name(137), exit_codes.signal_name(143), exit_codes.signal_name(124)) == \
        ("SIGKILL", "SIGTERM", None)
    assert restart.describe_code(137) == "killed by SIGKILL (exit 137)" and restart.describe_code(1) == "exit 1"


def test_backoff_doubles_up_to_a_cap():
    assert [restart.backoff_s(k) for k in (1, 2, 3, 4, 5)] == [5, 10, 20, 40, 60]
    assert restart.backoff_s(1, 1.0) == 1 and restart.backoff_s(3, 0.0) == 0


def test_own_options_and_the_launchers_arguments():
    own, rest = restart.split_own_options(["--max-restarts", "2", "--restart-backoff=1", "--num_gpus", "2", "x.py"])
    assert own == ["--max-restarts", "2", "--restart-backoff=1"] and rest == ["--num_gpus", "2", "x.py"]
    assert restart.split_own_options(["-np", "2", "prog", "--max-restarts", "1"])[0] == []  # the program's, not ours
    argv = ["--master_port", "2345", "--node_rank=1", "bert_ds/runtime/pretrain.py", "--output", "runs/a"]
    assert restart.master_port(argv, {}) == 2345 and restart.node_rank(argv) == 1
    assert restart.master_port(["-np", "2"], {"MASTER_PORT": "3456"}) == 3456
    assert restart.master_port([], {}) == 29500 and restart.node_rank([]) == 0
    assert restart.run_dir_of(argv) == Path("runs/a") and restart.run_dir_of(["x.py"]) is None


def test_a_restart_resumes_pretraining_and_leaves_other_programs_alone():
    argv = ["--num_gpus", "2", "bert_ds/runtime/pretrain.py", "--output", "r", "--resume", "none"]
    assert restart.resume_args(argv) == [*argv, "--resume", "auto"]
    mpirun = ["-np", "2", sys.executable, "-m", "bert_ds.runtime.pretrain", "--output", "r"]
    assert restart.resume_args(mpirun)[-2:] == ["--resume", "auto"]
    assert restart.resume_args([*mpirun, "--resume", "auto"]) == [*mpirun, "--resume", "auto"]
    assert restart.resume_args(["-np", "2", "my_script.py", "--x"]) == ["-np", "2", "my_script.py", "--x"]


def test_the_port_is_free_only_once_its_listener_is_gone():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert not restart.port_free(port)
        assert restart.wait_port_free(port, timeout_s=0.5, poll_s=0.1) is None
    assert restart.port_free(port) and restart.wait_port_free(port, timeout_s=0.5) == pytest.approx(0, abs=0.1)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_stale_all_reduce_buffers_of_the_port_go_mapped_ones_stay():
    port = 40000 + uuid.uuid4().int % 20000
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_"
    stale, live, other = (Path("/dev/shm") / f"{name}0", Path("/dev/shm") / f"{name}1",
                          Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port + 1}_0")
    for seg in (stale, live, other):
        seg.write_bytes(b"\0" * 4096)
    proc = subprocess.Popen([sys.executable, "-c", MAP_AND_WAIT, str(live)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "mapped"
        assert restart.release_shm_buffers(port) == [stale]
        assert not stale.exists() and live.exists() and other.exists()
    finally:
        proc.communicate("go\n", timeout=HANG_GUARD_S)
        for seg in (stale, live, other):
            seg.unlink(missing_ok=True)


def _attempts(codes: list[int], seen: list):
    it = iter(codes)

    def attempt(args: list[str], restart_follows: bool) -> restart.Ended:
        seen.append((list(args), restart_follows))
        return restart.Ended(next(it), False, "rank 1 (host h, local rank 1, pid 7)")
    return attempt


ARGV = ["--master_port", "0", "bert_ds/runtime/pretrain.py", "--output"]


def test_three_failures_end_with_the_last_code_and_a_summary_of_each(tmp_path, capfd):
    seen: list = []
    loop = restart.Restarts("bert-ds deepspeed", [*ARGV, str(tmp_path)], 2, 0.0, hosts_rank0=False)
    assert loop.run(_attempts([137, 1, 124], seen)) == 124
    assert [follows for _, follows in seen] == [True, True, False]
    assert [args[-2:] for args, _ in seen] == [["--output", str(tmp_path)], ["--resume", "auto"], ["--resume", "auto"]]
    err = capfd.readouterr().err.splitlines()
    assert err[0].startswith("bert-ds deepspeed: restart 1 of 2: rank 1 (host h, local rank 1, pid 7) killed by "
                             "SIGKILL (exit 137); resuming from the start (no checkpoint yet) in 0 s; "), err
    assert err[1].startswith("bert-ds deepspeed: restart 2 of 2: rank 1 (host h, local rank 1, pid 7) exit 1;"), err
    assert err[-1].startswith("bert-ds deepspeed: 3 attempt(s), --max-restarts 2 used up: attempt 1: rank 1 "), err
    assert err[-1].endswith("attempt 3: rank 1 (host h, local rank 1, pid 7) exit 124 after 0 s; exit 124"), err
    records = [json.loads(line) for line in (tmp_path / restart.LOG_NAME).read_text().splitlines()]
    assert [(r.get("restart"), r.get("signal")) for r in records] == [(1, "SIGKILL"), (2, None), (None, None)]
    assert [a["code"] for a in records[-1]["attempts"]] == [137, 1, 124] and records[-1]["exit"] == 124
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert [e.step for e in events.Tensors("restarts/text_summary")] == [1, 2]


@pytest.mark.parametrize("code", [ExitCode.BAD_INPUT, ExitCode.NONFINITE, ExitCode.IO_ERROR, ExitCode.PREEMPTED, 0])
def test_no_restart_after_a_final_code(code, tmp_path):
    seen: list = []
    loop = restart.Restarts("bert-ds deepspeed", [*ARGV, str(tmp_path)], 3, 0.0, hosts_rank0=False)
    assert loop.run(_attempts([code], seen)) == code and len(seen) == 1
    assert not (tmp_path / restart.LOG_NAME).exists()


def test_a_recovered_run_exits_0_and_says_how(tmp_path, capfd):
    seen: list = []
    loop = restart.Restarts("bert-ds mpirun", [*ARGV, str(tmp_path)], 3, 0.0, hosts_rank0=False)
    assert loop.run(_attempts([1, 0], seen)) == 0 and len(seen) == 2
    assert capfd.readouterr().err.splitlines()[-1].startswith("bert-ds mpirun: 2 attempt(s), done: attempt 1: ")


def test_a_signal_between_attempts_stops_the_restarts(tmp_path):
    seen: list = []
    loop = restart.Restarts("bert-ds deepspeed", [*ARGV, str(tmp_path)], 3, 0.5, hosts_rank0=False)
    assert loop.run(_attempts([137, 0], seen), stopping=lambda: True) == 137 and len(seen) == 1


HOLD_PORT = """
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_the_next_attempt_starts_only_once_the_port_is_free(tmp_path):
    """A leftover process of the failed attempt still listens on MASTER_PORT for 2 s (the "MASTER_PORT ... is already
    in use" of a start too early): the restart waits until the port binds."""
    from tests.helpers import free_port

    port = free_port()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_PORT, str(port), "2"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "listening"
    free_at_start: list[bool] = []

    def attempt(args: list[str], restart_follows: bool) -> restart.Ended:
        free_at_start.append(restart.port_free(port))
        return restart.Ended(ExitCode.FAILED if len(free_at_start) == 1 else ExitCode.OK, False)

    try:
        loop = restart.Restarts("bert-ds deepspeed", ["--master_port", str(port), "x.py", "--output", str(tmp_path)],
                                1, 0.0, hosts_rank0=True)
        assert loop.run(attempt) == 0
    finally:
        holder.kill()
        holder.wait()
    assert free_at_start == [False, True]
