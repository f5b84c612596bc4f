#!/usr/bin/env python
"""Convert a bert_ds DeepSpeed checkpoint to a verified Hugging Face BertForPreTraining directory.

    python tools/convert_checkpoint.py --checkpoint RUN_DIR/checkpoints --out hf_model [--tag TAG] [--no-verify]

Exit codes: 0 ok, 1 the reloaded model or tokenizer does not reproduce bert_ds's logits or token ids, 2 bad input.
"""

from __future__ import annotations

import argparse
import sys

from bert_ds.export import ExportError, VerificationError, convert_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="DeepSpeed save dir (holds 'latest', tags, "
                        "model_config.json, tokenizer/)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    parser.add_argument("--out", required=True, help="output HF directory (must not exist or be empty)")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip reloading the output with transformers and comparing logits and token ids")
    args = parser.parse_args(argv)
    try:
        diffs = convert_checkpoint(args.checkpoint, args.out, tag=args.tag, verify=args.verify)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except VerificationError as exc:
        print(f"verification failed: {exc}", file=sys.stderr)
        return 1
    if diffs is None:
        print(f"wrote {args.out} (not verified)")
    else:
        print(f"wrote {args.out}; verified against bert_ds: same token ids, max |MLM logit diff| {diffs[0]:.2e}, "
              f"max |NSP logit diff| {diffs[1]:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
