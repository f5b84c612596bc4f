"""bert_ds run directories holding checkpoints of a tiny model, for the exporter's and evaluation's tests.

``python -m tests.helpers.ds_checkpoint OUT --stages 0 2 3`` trains one step with real DeepSpeed on one CPU/gloo rank
per stage and saves it with :func:`bert_ds.checkpoint.save_checkpoint` (the training loop's save) into the run
directory ``OUT/stage<N>``, plus ``OUT/stage<N>_reference.pt`` (the module's weights after the step). It runs as a
separate process so DeepSpeed's process group stays out of pytest.

:func:`write_stage0_run` writes a ZeRO-0 checkpoint without DeepSpeed, in process: a stage-0 tag holds the model as
``mp_rank_00_model_states.pt``'s ``module`` entry, which is all the exporter reads from it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from bert_ds.checkpoint import RUN_STATE_NAME, checkpoint_dir, tag_for, write_run_metadata
from bert_ds.config import BertConfig, model_preset
from bert_ds.data.tokenizer import read_lowercase
from bert_ds.model import BertForPreTraining
from bert_ds.recipe import load_recipe
from tests.helpers import free_port
from tests.helpers.run_state import fake_run_state

REPO = Path(__file__).resolve().parents[2]
TAG = tag_for(0, 1)
WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "table", "big", "small", "red", "blue",
         "is", "was", "and", "it", "he", "she", ".", ",", "##s", "##ed", "##ing"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
RECIPE = REPO / "ds_configs" / "tiny_cpu.json"


def stage_checkpoint_dir(out: Path, stage: int) -> Path:
    """The checkpoint directory (``latest``, tags, ``model_config.json``, ``tokenizer/``) written for ``stage``."""
    return checkpoint_dir(out / f"stage{stage}")


def write_tokenizer_dir(directory: Path, vocab: list[str], files: dict[str, str] | None = None) -> Path:
    """A tokenizer directory: ``vocab.txt`` (one token a line) plus ``files`` (name -> text) as given."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("".join(f"{t}\n" for t in vocab), encoding="utf-8")
    for name, text in (files or {}).items():
        (directory / name).write_text(text, encoding="utf-8")
    return directory


def tiny_config(vocab_size: int) -> BertConfig:
    # Vocabulary padded to a multiple of 16 so the export's trimming is exercised.
    return model_preset("tiny", vocab_size=vocab_size, pad_vocab_to_multiple_of=16, max_position_embeddings=64)


def write_stage0_run(run_dir: Path, model: BertForPreTraining, tokenizer_source: Path, tag: str = TAG) -> Path:
    """A complete ZeRO-0 checkpoint of ``model`` in bert_ds's layout; returns its checkpoint directory."""
    write_run_metadata(run_dir, load_recipe(RECIPE), model.config, tokenizer_source)
    ckpt = checkpoint_dir(run_dir)
    (ckpt / tag).mkdir()
    torch.save({"module": model.state_dict()}, ckpt / tag / "mp_rank_00_model_states.pt")
    state = fake_run_state(tokenizer_dir=tokenizer_source, lowercase=read_lowercase(tokenizer_source))
    (ckpt / tag / RUN_STATE_NAME).write_text(json.dumps(state.to_dict()) + "\n")
    (ckpt / "latest").write_text(tag)
    return ckpt


def write_checkpoint(out: Path, stage: int) -> None:
    import deepspeed

    from bert_ds.checkpoint import save_checkpoint

    torch.manual_seed(stage)
    config = tiny_config(len(VOCAB))
    model = BertForPreTraining(config, kernels="torch")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    zero = {"stage": stage}
    if stage == 3:
        # Partition every tensor, however small: the tied decoder then really reads a gathered external parameter.
        zero["stage3_param_persistence_threshold"] = 0
    ds_config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                 "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, len(VOCAB), (2, 16), generator=gen)
    out_step = engine(input_ids, torch.zeros_like(input_ids), torch.ones_like(input_ids),
                      torch.tensor([[1, 4, 0], [2, 0, 0]]), torch.tensor([[7, 9, -100], [11, -100, -100]]),
                      torch.tensor([0, 1]))
    engine.backward(out_step.loss)
    engine.step()
    run_dir = out / f"stage{stage}"
    tokenizer = write_tokenizer_dir(out / "tokenizer_src", VOCAB, {"tokenizer_meta.json": '{"lowercase": true}\n'})
    write_run_metadata(run_dir, load_recipe(RECIPE), config, tokenizer)
    save_checkpoint(engine, run_dir, TAG, fake_run_state(tokenizer_dir=tokenizer, zero_stage=stage), keep_last_k=1)
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            reference = {k: v.detach().clone().float() for k, v in engine.module.state_dict().items()}
    else:
        reference = {k: v.detach().clone().float() for k, v in engine.module.state_dict().items()}
    torch.save(reference, out / f"stage{stage}_reference.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 2, 3])
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    from bert_ds.runtime.distributed import join_gloo_group

    join_gloo_group()
    args.out.mkdir(parents=True, exist_ok=True)
    for stage in args.stages:
        write_checkpoint(args.out, stage)


if __name__ == "__main__":
    from bert_ds.lifecycle.rank_exit import end_process

    main()
    end_process(0)  # a DeepSpeed rank: no C++ teardown of gloo's threads (see rank_exit)
