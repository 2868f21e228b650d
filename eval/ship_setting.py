"""Write a head directory that carries a measured decode setting, for selfspec/heads/shipped/<model>/ (issue 19).

The shipped setting of a model is whatever measured fastest on Spec-Bench: a head (here an untrained one, e.g. the
logit lens at the last layer), its draft precision, exit layer, and decode settings (K, dynamic K, lookup mode).
`head=default` then finds it by the model's fingerprint and decodes with those settings unless the user sets them.

    python eval/ship_setting.py --model smollm2_135m --type lens --exit-layer 30 --precision int8 \
        --decode draft_len=6 lookup=true lookup_mode=checked --out selfspec/heads/shipped/smollm2_135m

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
                    help="score only the first N token ids when drafting (byte-level BPE numbers tokens in merge order)")
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
        m = SelfSpecModel.from_pretrained(args.model, head=args.type, exit_layer=args.exit_layer,
                                          draft_precision=args.precision,
                                          **({"draft_vocab": args.draft_vocab} if args.draft_vocab else {}))
        extra = {"decode": decode, "measured": args.note} if args.note else {"decode": decode}
        path = save_head(m.head, args.out, m.backbone, extra=extra)
    except SelfSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
