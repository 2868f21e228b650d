"""python -m selfspec.generate model=smollm2_135m head=lens head.exit_layer=8 decode.draft_len=4 'prompt="..."'

Prints the text and one stats line; `output=FILE.json` also writes ids, text and stats. Nothing else is
written (no log file: Hydra's job logging goes to stderr only, see conf/generate.yaml).

The prompt follows the API's rule (SelfSpecModel.prompt_chat): through the tokenizer's chat template when it has one,
unless chat=false (raw text to continue). 'prompt=[first,second]' decodes several, one after another (output=
then holds a list). stream=true prints the text as it is committed (transformers' TextStreamer).
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from selfspec.api import SelfSpecModel
from selfspec.cli.config import decode_config, head_config, model_config
from selfspec.cli.hydra_utils import decode_keys_set, run_or_exit
from selfspec.decoding.config import with_tuned_settings
from selfspec.errors import SelfSpecError, check
from selfspec.model.tokens import text_streamer
from selfspec.utils.io import atomic_write_json
from selfspec.utils.paths import conf_dir


def stats_line(stats: dict) -> str:
    ar = stats.get("accept_rate")
    return (
        f"[{stats['strategy']}] new_tokens={stats['new_tokens']} verify_steps={stats['verify_steps']} "
        f"tau={stats['tau']:.2f} accept_rate={'-' if ar is None else f'{ar:.3f}'} "
        f"tokens_per_s={stats['tokens_per_s']:.1f} draft_s={stats['draft_s']:.2f} verify_s={stats['verify_s']:.2f}"
    )


def run(cfg: DictConfig) -> dict | list[dict]:
    prompt = OmegaConf.to_container(cfg.prompt) if OmegaConf.is_list(cfg.prompt) else cfg.prompt
    prompts = prompt if isinstance(prompt, list) else [prompt]
    check(bool(prompts) and all(p is not None and str(p).strip() != "" for p in prompts),
          "prompt: must not be empty (pass 'prompt=\"...\"')")
    prompts = [str(p) for p in prompts]
    dcfg = decode_config(cfg.decode)
    hcfg = head_config(cfg.head)
    mcfg = model_config(cfg.model)
    if cfg.output:  # fail before the (slow) model load when the output cannot be written
        out = Path(str(cfg.output)).expanduser()
        check(not out.is_dir(), f"output={cfg.output!r}: is a directory; give a file name (e.g. out.json)")
        out_dir = out.resolve().parent
        check(out_dir.is_dir(), f"output={cfg.output!r}: directory {out_dir} does not exist")
    model = SelfSpecModel.from_pretrained(mcfg, head=hcfg if dcfg.strategy == "selfspec" else None)
    user_set = decode_keys_set(cfg.decode)  # command line, yaml, decode= file: every route the user has
    if dcfg.tree == "auto":  # the head's tuned tree, when it carries one (else the engine says how to resolve auto)
        user_set = set(user_set) - {"tree"}
    saved = {**(model.head.decode_settings if model.head is not None else {}), **model._auto_decode}
    dcfg, tuned = with_tuned_settings(dcfg, saved, user_set)
    dcfg.check_fits(model.backbone.max_positions)  # before the engine allocates anything for it
    streamer = None
    if cfg.get("stream"):
        streamer = text_streamer(model.tokenizer)
    results = model.generate(prompts if isinstance(prompt, list) else prompts[0], chat=cfg.chat, decode=dcfg, streamer=streamer)
    records = []
    for i, result in enumerate(results if isinstance(results, list) else [results]):
        if streamer is None:
            print(result.text)
        if model.auto_choice is not None and i == 0:
            print(model.auto_choice.reason)
        if tuned and i == 0:
            print("decode settings from the head: " + ", ".join(f"{k}={getattr(dcfg, k)}" for k in tuned))
        print(stats_line(result.stats))
        records.append({"token_ids": result.token_ids, "text": result.text, "stats": result.stats, "seed": result.decode.seed})
    record = records if isinstance(prompt, list) else records[0]
    if cfg.output:
        try:
            atomic_write_json(Path(str(cfg.output)).expanduser(), record, default=None)
        except OSError as exc:  # e.g. a directory created there meanwhile, a read-only place
            raise SelfSpecError(f"output={cfg.output!r}: cannot write ({exc.strerror or exc})")
    return record


@hydra.main(config_path=str(conf_dir()), config_name="generate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_or_exit(run, cfg)


if __name__ == "__main__":
    main()
