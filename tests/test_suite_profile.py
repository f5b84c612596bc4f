"""``bert_ds.devtools.suite_profile``: CPU time of a command's processes, sorted by kind and charged to the test named
in their environment (or their parent's)."""

from __future__ import annotations

import json
import sys
import textwrap

from bert_ds.devtools.suite_profile import Proc, charged_test, kind_of, main, report

# A parent that starts two children under two test names: one burns ~1 CPU second, the other sleeps; a grandchild of
# the burning one has no PYTEST_CURRENT_TEST of its own and burns too.
_SCRIPT = textwrap.dedent("""
    import os, subprocess, sys, time
    burn = "import time\\nend = time.process_time() + {seconds}\\nwhile time.process_time() < end: pass"
    if sys.argv[1:] == ["grandchild"]:
        exec(burn.format(seconds=0.6))
        sys.exit(0)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    hot = subprocess.Popen([sys.executable, "-c", burn.format(seconds=1.0) +
                            "\\nimport subprocess, sys\\nsubprocess.run([sys.executable, sys.argv[1], 'grandchild'])",
                            __file__], env={**env, "PYTEST_CURRENT_TEST": "tests/x.py::test_hot (call)"})
    cold = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"],
                            env={**env, "PYTEST_CURRENT_TEST": "tests/x.py::test_cold (call)"})
    sys.exit(hot.wait() or cold.wait() or 3)
""")


def test_cpu_is_charged_to_the_test_that_started_the_process(tmp_path, capsys):
    script = tmp_path / "tree.py"
    script.write_text(_SCRIPT)
    out = tmp_path / "procs.json"
    assert main(["--interval", "0.05", "--json", str(out), "--", sys.executable, str(script)]) == 3  # its exit code
    procs = [Proc(**{k: v for k, v in p.items() if k != "kind"}) for p in json.loads(out.read_text())]
    by_pid = {p.pid: p for p in procs}
    charged: dict[str, float] = {}
    for proc in procs:
        charged[charged_test(proc, by_pid)] = charged.get(charged_test(proc, by_pid), 0.0) + proc.cpu_s
    # 1.0 + 0.6 s burnt under test_hot (the grandchild through its parent), less what sampling misses; the sleeper
    # used almost nothing.
    assert 1.2 < charged["tests/x.py::test_hot"] < 3.0, charged
    assert charged.get("tests/x.py::test_cold", 0.0) < 0.5, charged
    printed = capsys.readouterr().out
    assert "exit 3 after" in printed and "tests/x.py::test_hot  (python=" in printed, printed


def test_kinds_from_command_lines():
    assert kind_of("/v/bin/python -u /r/bert_ds/runtime/pretrain.py --local_rank=1 --recipe r.json") == "rank"
    assert kind_of("/v/bin/python -u -m tests.helpers.rank_zygote torch,deepspeed") == "rank"  # the forked ranks
    assert kind_of("/v/bin/python -u -m deepspeed.launcher.launch --world_info=e30=") == "ds-launch"
    assert kind_of("/v/bin/python -u -m deepspeed.launcher.runner --num_gpus 2 x.py") == "ds-runner"
    assert kind_of("/v/bin/python -m bert_ds.lifecycle.supervise --num_gpus 2 x.py") == "supervisor"
    assert kind_of("/usr/lib/gcc/x86_64-linux-gnu/12/cc1plus -quiet x.cpp") == "compiler"
    assert kind_of("/v/bin/python -c import sys;exec(eval(sys.stdin.readline()))") == "pytest-worker"
    assert kind_of("sleep 5") == "other"


def test_report_orders_tests_by_cpu():
    procs = [Proc(1, 0, "python -m pytest", "", 1.0), Proc(2, 1, "cc1plus x.cpp", "t.py::a (setup)", 5.0),
             Proc(3, 2, "python -u bert_ds/runtime/pretrain.py --local_rank=0", "", 2.0),
             Proc(4, 1, "python b.py", "t.py::b (call)", 3.0)]
    text = report(procs)
    assert text.index("t.py::a  (compiler=5 rank=2)") < text.index("t.py::b  (python=3)"), text
    assert "CPU seconds seen: 11 in 4 processes" in text, text
