"""``bert_ds.lifecycle.startup_gc``: a rank's start-up runs with the cyclic garbage collector off; at the first step
start-up's garbage is collected, what survives frozen until exit, and the collector is back on. In a fresh
interpreter, since it changes the process's collector for good."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers import HANG_GUARD_S, child_env

SCRIPT = textwrap.dedent("""
    import atexit, gc, json, sys, weakref
    from bert_ds.lifecycle import startup_gc

    assert startup_gc.resume() == 0 and gc.isenabled()  # never paused: nothing changes
    startup_gc.pause()
    paused = {"enabled": gc.isenabled(), "paused": startup_gc.paused()}
    class Node:
        pass
    refs = []
    for _ in range(1000):  # start-up garbage in cycles: only a collection frees it
        a, b = Node(), Node()
        a.other, b.other = b, a
        refs.append(weakref.ref(a))
    del a, b
    kept = [Node() for _ in range(1000)]
    garbage = sum(r() is not None for r in refs)
    frozen = startup_gc.resume()
    print(json.dumps({**paused, "garbage": garbage, "frozen": frozen, "freeze_count": gc.get_freeze_count(),
                      "freed": sum(r() is None for r in refs), "kept_tracked": sum(type(o) is Node for o in
                      gc.get_objects()), "enabled_after": gc.isenabled(), "paused_after": startup_gc.paused(),
                      "again": startup_gc.resume(),
                      "unfrozen_at_exit": (atexit._run_exitfuncs(), gc.get_freeze_count())[1]}))
""")


def test_pause_then_resume_collects_freezes_and_turns_the_collector_back_on():
    import json

    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=child_env(),
                          timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["enabled"] is False and got["paused"] is True
    assert got["garbage"] == 1000  # the cycles outlived their names while the collector was off ...
    assert got["freed"] == 1000  # ... and the collection at resume freed them, not froze them
    assert got["frozen"] == got["freeze_count"] > 1000
    assert got["kept_tracked"] == 0  # what survived is frozen: gc.get_objects() leaves out the frozen generation
    assert got["enabled_after"] is True and got["paused_after"] is False and got["again"] == 0
    assert got["unfrozen_at_exit"] == 0  # a teardown (an exception escaping main) collects the heap as before
