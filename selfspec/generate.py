"""python -m selfspec.generate model=smollm2_135m head=lens head.exit_layer=8 decode.draft_len=4 'prompt="..."'

Prints the text and one stats line; `output=FILE.json` also writes ids, text and stats.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

from selfspec.errors import SelfSpecError, check
from selfspec.hydra_utils import print_user_error_and_exit
from selfspec.paths import conf_dir


def stats_line(stats: dict) -> str:
    ar = stats.get("accept_rate")
    return (
        f"[{stats['strategy']}] new_tokens={stats['new_tokens']} verify_steps={stats['verify_steps']} "
        f"tau={stats['tau']:.2f} accept_rate={'-' if ar is None else f'{ar:.3f}'} "
        f"tokens_per_s={stats['tokens_per_s']:.1f} draft_s={stats['draft_s']:.2f} verify_s={stats['verify_s']:.2f}"
    )


def run(cfg: DictConfig) -> dict:
    from selfspec.api import SelfSpecModel
    from selfspec.config import decode_config, head_config, model_config

    check(cfg.prompt is not None and str(cfg.prompt).strip() != "", "prompt: must not be empty (pass 'prompt=\"...\"')")
    dcfg = decode_config(cfg.decode)
    hcfg = head_config(cfg.head)
    mcfg = model_config(cfg.model)
    if cfg.output:  # fail before the (slow) model load when the output cannot be written
        out_dir = Path(cfg.output).expanduser().resolve().parent
        check(out_dir.is_dir(), f"output={cfg.output!r}: directory {out_dir} does not exist")
    model = SelfSpecModel.from_pretrained(mcfg, head=hcfg if dcfg.strategy == "self_speculative" else None)
    chat = cfg.chat if cfg.chat is not None else bool(model.tokenizer.chat_template)
    result = model.generate(str(cfg.prompt), chat=chat, decode=dcfg)
    print(result.text)
    print(stats_line(result.stats))
    record = {"token_ids": result.token_ids, "text": result.text, "stats": result.stats}
    if cfg.output:
        path = Path(cfg.output).expanduser()
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=2))
        os.replace(tmp, path)
    return record


@hydra.main(config_path=str(conf_dir()), config_name="generate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except SelfSpecError as exc:
        print_user_error_and_exit(exc)


if __name__ == "__main__":
    main()
