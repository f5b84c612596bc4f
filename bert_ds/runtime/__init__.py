"""The training runtime: what runs on every rank of a pre-training job.

``preflight`` checks recipe, shards and run directory before compute; ``distributed`` sets up the process group;
``caches`` places the compiled-extension and Triton caches; ``engine`` wires model, optimizer and DeepSpeed together;
``trainer`` runs the step loop; ``pretrain`` is the phase loop and CLI; ``metrics`` logs; ``memory`` estimates a
recipe's memory. The process around the ranks (supervisors, hostfiles, signals, the hang watchdog, how a rank ends) is
:mod:`bert_ds.lifecycle`, below this package. DeepSpeed's private state and version facts are read in one leaf below
both, :mod:`bert_ds.deepspeed_internals`.
"""
