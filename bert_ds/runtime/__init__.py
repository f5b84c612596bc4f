"""The training runtime: what runs on every rank of a pre-training job.

``preflight`` checks recipe, shards and run directory before compute; ``distributed`` sets up the process group;
``engine`` wires model, optimizer and DeepSpeed together; ``trainer`` runs the step loop; ``pretrain`` is the phase
loop and CLI; ``launch`` turns a cluster's allocation into DeepSpeed's hostfile; ``metrics`` logs. DeepSpeed's private
state and version facts are read in one leaf below this package, :mod:`bert_ds.deepspeed_internals`.
"""
