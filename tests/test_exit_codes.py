"""The exit-code table lives in ``bert_ds/exit_codes.py``; the README and the Slurm scripts state the same numbers."""

from __future__ import annotations

import re

from bert_ds.exit_codes import ExitCode
from tests.helpers.ranks import REPO


def test_the_readme_states_exactly_the_table():
    text = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    sentence = re.search(r"Exit codes: (.*?)\.", text).group(1)
    assert sorted(int(n) for n in re.findall(r"(?:^|, )(\d+) ", sentence)) == sorted(ExitCode)


def test_the_slurm_scripts_requeue_on_the_preemption_code():
    script = (REPO / "slurm" / "pretrain_common.sh").read_text()
    assert re.search(r"^EXIT_PREEMPTED=(\d+)", script, re.M).group(1) == str(int(ExitCode.PREEMPTED))


def test_pretrain_and_the_trainer_use_the_table():
    from bert_ds.runtime import pretrain, stall, trainer

    assert (pretrain.EXIT_FAILED, pretrain.EXIT_BAD_INPUT, pretrain.EXIT_NONFINITE, trainer.EXIT_PREEMPTED,
            stall.EXIT_STALLED) == (ExitCode.FAILED, ExitCode.BAD_INPUT, ExitCode.NONFINITE, ExitCode.PREEMPTED,
                                    ExitCode.STALLED)
