"""Write real DeepSpeed checkpoints of a tiny bert_ds model on CPU (one gloo rank), laid out as the training engine
does: ``<out>/stage<N>/{latest,<tag>/,model_config.json,tokenizer/}`` plus ``reference.pt`` (the module's weights
after the step, for comparison). Run as a script so DeepSpeed's process-group setup stays out of pytest.

    python tests/export/make_ds_checkpoint.py OUT_DIR --stages 0 2 3
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

import torch

from bert_ds.config import model_preset
from bert_ds.model import BertForPreTraining

TAG = "global_step1"
WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "table", "big", "small", "red", "blue",
         "is", "was", "and", "it", "he", "she", ".", ",", "##s", "##ed", "##ing"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_checkpoint(out: Path, stage: int) -> None:
    import deepspeed

    torch.manual_seed(stage)
    # Pad the vocabulary to 16 rows beyond it so the export's trimming is exercised.
    config = model_preset("tiny", vocab_size=len(VOCAB), pad_vocab_to_multiple_of=16, max_position_embeddings=64)
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
    save_dir = out / f"stage{stage}"
    engine.save_checkpoint(str(save_dir), tag=TAG)
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            reference = {k: v.detach().clone().float() for k, v in engine.module.state_dict().items()}
    else:
        reference = {k: v.detach().clone().float() for k, v in engine.module.state_dict().items()}
    torch.save(reference, out / f"stage{stage}_reference.pt")
    config.save(save_dir / "model_config.json")
    (save_dir / "tokenizer").mkdir()
    (save_dir / "tokenizer" / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    (save_dir / "tokenizer" / "tokenizer_meta.json").write_text('{"lowercase": true}\n')


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 2, 3])
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    args.out.mkdir(parents=True, exist_ok=True)
    for stage in args.stages:
        write_checkpoint(args.out, stage)


if __name__ == "__main__":
    main()
