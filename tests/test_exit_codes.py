"""The exit-code table lives in ``bert_ds/exit_codes.py``; the README and the Slurm scripts state the same numbers."""

from __future__ import annotations

import re
import subprocess

from bert_ds.exit_codes import ExitCode
from tests.helpers.ranks import REPO


def test_the_readme_states_exactly_the_table():
    text = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    sentence = re.search(r"Exit codes: (.*?)\.", text).group(1)
    assert sorted(int(n) for n in re.findall(r"(?:^|, )(\d+) ", sentence)) == sorted(ExitCode)


def test_the_slurm_scripts_requeue_on_the_preemption_code():
    script = (REPO / "slurm" / "pretrain_common.sh").read_text()
    assert re.search(r"^EXIT_PREEMPTED=(\d+)", script, re.M).group(1) == str(int(ExitCode.PREEMPTED))


def test_the_slurm_scripts_retry_exactly_the_retryable_codes():
    """``RETRYABLE_EXITS`` (requeue, counted against MAX_REQUEUES) is what a restart can cure: a pre-emption and a
    stalled rank, both resumed from the newest checkpoint; never bad input or a non-finite loss, which a restart
    repeats. The lines that define it are run by bash, so the set is the one the script computes."""
    script = (REPO / "slurm" / "pretrain_common.sh").read_text()
    lines = [line.split("#")[0] for line in re.findall(r"^(?:EXIT_[A-Z]+=\d+|RETRYABLE_EXITS=).*$", script, re.M)]
    proc = subprocess.run(["bash", "-c", "\n".join([*lines, 'echo "$RETRYABLE_EXITS"'])], capture_output=True,
                          text=True, timeout=60, check=True)
    assert sorted(int(n) for n in proc.stdout.split()) == sorted([ExitCode.PREEMPTED, ExitCode.STALLED])


def test_pretrain_and_the_trainer_use_the_table():
    from bert_ds.lifecycle import hang_watchdog
    from bert_ds.runtime import pretrain, trainer

    assert (pretrain.EXIT_FAILED, pretrain.EXIT_BAD_INPUT, pretrain.EXIT_NONFINITE, trainer.EXIT_PREEMPTED,
            hang_watchdog.EXIT_STALLED) == (ExitCode.FAILED, ExitCode.BAD_INPUT, ExitCode.NONFINITE,
                                            ExitCode.PREEMPTED, ExitCode.STALLED)
