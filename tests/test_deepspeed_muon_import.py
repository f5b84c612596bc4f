"""DeepSpeed's Muon module imported by :func:`bert_ds.deepspeed_internals.import_muon_compiling_on_first_call`: no
inductor at import, each ``torch.compile`` its import applies made on the function's first call with the decorator's
arguments, ``torch.compile`` itself left as it was (also when the import fails). In a fresh interpreter: the test
process may have imported the module already."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import HANG_GUARD_S, child_env
from tests.helpers.ranks import REPO

SCRIPT = r"""
import importlib.abc, json, sys
import torch

calls = []
def recording_compile(model=None, **options):  # stands in for torch.compile: records, returns the function itself
    if model is None:
        return lambda fn: recording_compile(fn, **options)
    calls.append([model.__qualname__, options])
    return model
torch.compile = recording_compile

from bert_ds.deepspeed_internals import MUON_MODULE, import_muon_compiling_on_first_call

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == MUON_MODULE:
            raise ImportError("planted")
sys.meta_path.insert(0, Refuse())
try:
    import_muon_compiling_on_first_call()
    failed = None
except ImportError as e:
    failed = str(e)
sys.meta_path.pop(0)
out = {"failed": failed, "restored_after_failure": torch.compile is recording_compile}

import_muon_compiling_on_first_call()
out.update(inductor="torch._inductor.compile_fx" in sys.modules, restored=torch.compile is recording_compile,
           after_import=list(calls))
from deepspeed.runtime.zero.muon import original_muon
G = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
got = original_muon.zeropower_via_newtonschulz5(G, steps=2)
out["after_call"] = list(calls)
out["equal"] = bool(torch.equal(got, original_muon.zeropower_via_newtonschulz5.__wrapped__(G, steps=2)))
original_muon.zeropower_via_newtonschulz5(G, steps=2)
out["calls_after_second_call"] = len(calls)
import_muon_compiling_on_first_call()  # imported: nothing to do
out["calls_after_second_import"] = len(calls)
print(json.dumps(out))
"""


def test_muon_imports_without_inductor_and_compiles_on_first_call():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=HANG_GUARD_S,
                          cwd=REPO, env=child_env())
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["failed"] == "planted" and out["restored_after_failure"], out
    assert out["restored"] and not out["inductor"], out
    assert out["after_import"] == [], out  # three decorated functions, none compiled yet
    assert out["after_call"] == [["zeropower_via_newtonschulz5", {}]], out
    assert out["equal"], out
    assert out["calls_after_second_call"] == 1 and out["calls_after_second_import"] == 1, out
