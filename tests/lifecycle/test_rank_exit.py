"""``bert_ds.lifecycle.rank_exit.end_process``: a rank ends without the interpreter's teardown, but with everything a
normal exit does first -- its exit code, non-daemon threads finished (an idle executor's worker stopped), ``atexit``
handlers run, Python's and C's buffered output written."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

from tests.helpers import HANG_GUARD_S, child_env

SCRIPT = textwrap.dedent("""
    import atexit, ctypes, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path
    from bert_ds.lifecycle.rank_exit import end_process

    out = Path(sys.argv[1])
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    def late():
        time.sleep(0.3)
        (out / "thread").write_text("finished")
    threading.Thread(target=late).start()
    # An idle executor worker (inductor keeps one after torch.compile): its thread only stops when told to
    pool = ThreadPoolExecutor(1)
    pool.submit(int).result()
    sys.stdout.write("python, not flushed")
    ctypes.CDLL(None).printf(b"C stdio, not flushed")
    end_process(7)
    (out / "after").write_text("never")
""")


def test_end_process_keeps_what_a_normal_exit_does(tmp_path):
    # stdout is a pipe: both Python's and C's buffers hold the text until flushed
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          env=child_env(), timeout=HANG_GUARD_S)
    assert done.returncode == 7, done.stderr
    assert "python, not flushed" in done.stdout and "C stdio, not flushed" in done.stdout, done.stdout
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "finished"
    assert not (tmp_path / "after").exists()
    assert done.stderr == ""


def test_pretrain_as_a_script_ends_through_it():
    from tests.helpers.runs import REPO

    source = (REPO / "bert_ds" / "runtime" / "pretrain.py").read_text()
    main_block = source[source.rindex('if __name__ == "__main__":'):]
    assert "end_process(main())" in main_block, main_block


def test_every_script_that_starts_a_process_group_ends_through_it():
    """A rank left to the C++ teardown aborted now and then after leaving its group (CI: the ZeRO state benchmark)."""
    from tests.helpers.runs import REPO

    starts = re.compile(r"init_distributed\(|deepspeed\.initialize\(|init_process_group\(")
    ranks = {}
    for path in sorted([*REPO.glob("bert_ds/**/*.py"), *REPO.glob("tools/*.py"), *REPO.glob("tests/helpers/*.py")]):
        source = path.read_text()
        if 'if __name__ == "__main__":' in source and starts.search(source):
            ranks[path.relative_to(REPO).as_posix()] = source[source.rindex('if __name__ == "__main__":'):]
    assert {"bert_ds/runtime/pretrain.py", "bert_ds/devtools/benchmarks/zero_state.py"} <= set(ranks)
    assert [name for name, block in ranks.items() if "end_process(" not in block] == []
