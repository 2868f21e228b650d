"""Write a head directory that carries a measured decode setting, for selfspec/heads/shipped/<model>/ (issue 19).

The shipped setting of a model is whatever measured fastest on Spec-Bench: a head (here an untrained one, e.g. the
logit lens at the last layer), its draft precision, exit layer, and decode settings (K, dynamic K, lookup mode).
`head=default` then finds it by the model's fingerprint and decodes with those settings unless the user sets them.

    python eval/ship_setting.py --model smollm2_135m --type lens --exit-layer 30 --precision int8 \
        --decode draft_len=6 lookup=true lookup_mode=checked --out selfspec/heads/shipped/smollm2_135m

--draft-vocab N --vocab-from sharegpt drafts over the N tokens most frequent in ShareGPT's assistant turns (the
tokenizer only, a minute or two; the vocabulary is saved in head.safetensors).

Values after --decode are YAML (true, 0.6, null). The head's config is validated by the same code that loads it.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from selfspec.api import SelfSpecModel
from selfspec.decoding.config import TUNED_KEYS, DecodeConfig
from selfspec.errors import SelfSpecError
from selfspec.heads import save_head


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--type", default="lens")
    ap.add_argument("--exit-layer", type=int, required=True)
    ap.add_argument("--precision", default="full")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="score only N token ids when drafting: the first N (byte-level BPE numbers tokens in merge "
                         "order), or the N most frequent with --vocab-from")
    ap.add_argument("--vocab-from", choices=["ids", "sharegpt"], default="ids",
                    help="sharegpt: count the tokens of ShareGPT's assistant turns (evaluation prompts excluded)")
    ap.add_argument("--vocab-conversations", type=int, default=4000, help="conversations counted with --vocab-from sharegpt")
    ap.add_argument("--decode", nargs="*", default=[], help="key=value decode settings the head carries")
    ap.add_argument("--note", default="", help="where the setting was measured (stored in head_config.json)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        decode = {}
        for item in args.decode:
            key, sep, raw = item.partition("=")
            if not sep or key not in TUNED_KEYS:
                raise SelfSpecError(f"--decode {item!r}: give key=value with key one of {', '.join(TUNED_KEYS)}")
            decode[key] = yaml.safe_load(raw)
        DecodeConfig(**decode)  # one line naming the key when a value is bad
        if args.vocab_from == "sharegpt" and not args.draft_vocab:
            raise SelfSpecError("--vocab-from sharegpt: give the vocabulary's size with --draft-vocab N")
        m = SelfSpecModel.from_pretrained(args.model, head=args.type, exit_layer=args.exit_layer,
                                          draft_precision=args.precision,
                                          **({"draft_vocab": args.draft_vocab} if args.draft_vocab else {}))
        extra = {"decode": decode, "measured": args.note} if args.note else {"decode": decode}
        if args.vocab_from == "sharegpt":
            m.head.set_draft_vocab(counted_vocab(m, args.draft_vocab, args.vocab_conversations))
        path = save_head(m.head, args.out, m.backbone, extra=extra)
    except SelfSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def counted_vocab(m, n: int, conversations: int):
    """The n token ids most frequent in ShareGPT's assistant turns, EOS always included; prints its coverage."""
    from selfspec.heads import draft_vocab_from_counts
    from selfspec.training.sharegpt import answer_token_counts

    counts, stats = answer_token_counts(m.tokenizer, m.backbone.vocab_size, conversations)
    ids = draft_vocab_from_counts(counts, n, m.eos_ids)
    share = float(counts[ids].sum()) / max(1, int(counts.sum()))
    print(f"draft vocabulary: {ids.numel()} ids, {share:.2%} of {stats['tokens']} answer tokens in "
          f"{stats['counted']} ShareGPT conversations ({stats['excluded']} left out as close to evaluation prompts)")
    return ids


if __name__ == "__main__":
    sys.exit(main())
