"""The training runtime: what runs on every rank of a pre-training job.

``preflight`` checks recipe, shards and run directory before compute; ``distributed`` sets up the process group;
``engine`` wires model, optimizer and DeepSpeed together; ``trainer`` runs the step loop; ``pretrain`` is the phase
loop and CLI; ``launch`` turns a cluster's allocation into DeepSpeed's hostfile; ``metrics`` logs; and
``deepspeed_internals`` is the one module that reads DeepSpeed's private state.
"""
