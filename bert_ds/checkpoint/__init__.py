"""The one owner of the run directory: it writes checkpoints, and it reads them back (resume, phase hand-off, export).

Everything else asks this package: the trainer saves through :func:`save_checkpoint` and resumes through
:func:`restore_run` / :func:`open_handoff`; the exporter (:mod:`bert_ds.export`) and evaluation
(:mod:`bert_ds.evaluate`) read through :func:`open_checkpoint` and :func:`consolidated_state_dict`, never by globbing
the files. By concern:

* :mod:`.layout`   names, tags, ``latest``, ``run_state.json``, model config, tokenizer copy, debris of killed saves,
                   ``last_save.json`` (the newest save's duration)
* :mod:`.save`     all ranks write a ``<tag>.tmp``, agree, then rank 0 publishes it and moves ``latest``; pruning
* :mod:`.restore`  mid-phase resume and phase hand-off (the ZeRO re-cut delegated to
                   :mod:`bert_ds.deepspeed_internals`), consolidated fp32 weights
* :mod:`.lock`     one live run per directory (``flock``), free-space pre-flight, readers holding a tag against
                   pruning (:func:`reading_tag`)
* :mod:`.integrity` every file's sha256 recorded in the tag's ``run_state.json`` at save, verified before reading

Every ``.pt`` file is read through :mod:`bert_ds.safe_load` (``weights_only`` with an allow-list). deepspeed is
imported only inside the functions that need it, so reading a run directory does not import it.
"""

from bert_ds.checkpoint.integrity import DamagedCheckpointError, check_tag, verify_tag
from bert_ds.checkpoint.layout import (
    CHECKPOINT_DIR,
    HEARTBEAT_DIR,
    LAST_SAVE_NAME,
    MODEL_CONFIG_NAME,
    RUN_STATE_NAME,
    RUN_STATE_SCHEMA,
    TAG_VOCAB_NAME,
    TOKENIZER_DIR_NAME,
    CheckpointRef,
    CheckpointSaveError,
    RunLockedError,
    RunState,
    TokenizerMismatch,
    checkpoint_dir,
    first_id_differing,
    heartbeat_file,
    list_tags,
    open_checkpoint,
    parse_tag,
    read_last_save,
    read_latest,
    read_model_config,
    read_run_state,
    remove_debris,
    resolve_tag,
    rng_file,
    save_time_line,
    set_aside_damaged,
    tag_for,
    tokenizer_dir,
    trained_tokenizer_mismatch,
    write_run_metadata,
)
from bert_ds.checkpoint.lock import (
    BYTES_PER_PARAMETER,
    LOCK_NAME,
    RunLock,
    acquire_run_lock,
    check_free_space,
    hold_run_dir,
    parameter_count,
    reading_tag,
)
from bert_ds.checkpoint.restore import (
    Handoff,
    RestoredRun,
    consolidated_state_dict,
    load_rng_state,
    open_handoff,
    restore_run,
    zero_partition_files,
)
from bert_ds.checkpoint.save import prune_checkpoints, save_checkpoint, save_rng_state
from bert_ds.safe_load import (
    ALLOWED_GLOBALS,
    CheckpointError,
    UnsafeCheckpointError,
    deepspeed_loads_weights_only,
    load_tensor_file,
)

__all__ = ["ALLOWED_GLOBALS", "BYTES_PER_PARAMETER", "CHECKPOINT_DIR", "HEARTBEAT_DIR", "LAST_SAVE_NAME", "LOCK_NAME",
           "MODEL_CONFIG_NAME", "RUN_STATE_NAME", "RUN_STATE_SCHEMA", "TAG_VOCAB_NAME", "TOKENIZER_DIR_NAME",
           "CheckpointError", "CheckpointRef", "CheckpointSaveError", "DamagedCheckpointError", "Handoff",
           "RestoredRun", "RunLock", "RunLockedError", "RunState", "TokenizerMismatch", "UnsafeCheckpointError",
           "acquire_run_lock", "check_free_space", "check_tag", "checkpoint_dir", "consolidated_state_dict",
           "deepspeed_loads_weights_only", "first_id_differing", "heartbeat_file", "hold_run_dir", "list_tags",
           "load_rng_state", "load_tensor_file", "open_checkpoint", "open_handoff", "parameter_count", "parse_tag",
           "prune_checkpoints", "read_last_save", "read_latest", "read_model_config", "read_run_state", "reading_tag",
           "remove_debris", "resolve_tag", "restore_run", "rng_file", "save_checkpoint", "save_rng_state",
           "save_time_line", "set_aside_damaged", "tag_for", "tokenizer_dir", "trained_tokenizer_mismatch",
           "verify_tag", "write_run_metadata", "zero_partition_files"]
