"""The process around a rank: how a pre-training job is started, watched, signalled and ended.

Around the ranks: ``supervise`` (``bert-ds deepspeed``: DeepSpeed's runner in a session of its own, pre-emption exits
75, no orphans) and ``supervise_mpirun`` (``bert-ds mpirun``, the same for Open MPI), both restarting the ranks after a
retryable failure through ``restart`` (which failures, the backoff, what is released between attempts, the records);
``hostfile`` (``bert-ds make-hostfile``: DeepSpeed's hostfile from a Slurm allocation or a host list, and the Slurm
facts every launch path shares). Inside each rank, beside its work: ``early_signals`` (a signal while the rank still
imports), ``startup_gc`` (the garbage collector off until the first step), ``preemption`` (SIGTERM/SIGUSR1 set a flag
the step loop reads), ``runner_watch`` (the ``deepspeed`` runner gone counts as a SIGTERM), ``hang_watchdog`` (a rank
that stops making progress ends the job, exit 124) and ``rank_exit`` (how a rank's process ends once its exit code is
decided). What runs on a rank is :mod:`bert_ds.runtime`, which arms these; nothing here imports it.

A SIGTERM (or SIGUSR1) on a rank, file by file: ``early_signals`` records it while ``runtime/pretrain.py`` imports;
``preemption`` (armed first thing by ``pretrain.main``) sets the flag, as ``runner_watch`` does when the runner is
gone; ``runtime/trainer.py``'s step loop all-reduces the flag, checkpoints at the step boundary and returns 75;
``pretrain.main`` reports 75 to ``supervise`` (its rank-side ``arm``/``report_exit``) and ``preemption.disarm()``s;
``rank_exit`` ends the process.
"""
