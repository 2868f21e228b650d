"""The target's own greedy answers, generated once with selfspec's engine and cached on disk.

Every head is scored teacher-forced on these answers. Each turn of a conversation is one `AnswerSeq`; later
turns carry the model's own earlier answers, rendered exactly as `selfspec.eval` renders them.

Past a final EOS the engine still verifies the drafts of the round that produced it: a draft made after an
accepted EOS is compared with the target's greedy continuation. So that a replay of the engine's schedule
(metrics.replay) counts those events too, each answer that ends in EOS also records `overhang` tokens of
that continuation. They never enter the agreement statistics.

The cache is JSON (token ids only), keyed by the model's fingerprint, the rendered prompts, max_new_tokens,
the EOS ids and the overhang: `<dir>/<model>-<key>.json`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from selfspec.decoding.engine import DecodeConfig, Decoder
from selfspec.utils.io import atomic_write_json, checksum_problem, safe_name
from selfspec.utils.paths import cache_dir

log = logging.getLogger(__name__)

FORMAT = "selfspec-answers/1"
OVERHANG = 16  # tokens past a final EOS: enough for a replay at any K <= OVERHANG + 1 (config allows 16)


@dataclass
class AnswerSeq:
    prompt_id: str
    category: str
    turn: int
    prompt_ids: list[int]
    answer_ids: list[int]    # the target's greedy answer, a final EOS included (as the engine returns it)
    overhang_ids: list[int]  # the greedy continuation past a final EOS (empty when the answer hit max_new_tokens)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.answer_ids + self.overhang_ids


def default_dir() -> Path:
    return cache_dir() / "analysis"


def cache_key(fingerprint: dict, items, first_prompts: list[list[int]], max_new_tokens: int, eos_ids: list[int],
              overhang: int) -> str:
    payload = {"format": FORMAT, "model": fingerprint, "max_new_tokens": max_new_tokens, "eos": sorted(eos_ids),
               "overhang": overhang, "items": [[it.id, it.category, list(it.turns)] for it in items],
               "first_prompts": first_prompts}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _read(path: Path, key: str) -> list[AnswerSeq] | None:
    try:
        problem = checksum_problem(path)
        if problem:
            raise ValueError(problem)
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or data.get("key") != key:
            raise ValueError("format or key differs")
        return [AnswerSeq(**s) for s in data["sequences"]]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("answers cache %s unusable (%s): generating again", path, exc)
        return None


def _write(path: Path, key: str, seqs: list[AnswerSeq]) -> None:
    atomic_write_json(path, {"format": FORMAT, "key": key, "sequences": [asdict(s) for s in seqs]}, indent=None,
                      checksum=True)


def generate_answers(backbone, renderer, items, max_new_tokens: int, eos_ids: list[int], overhang: int = OVERHANG,
                     progress=None) -> list[AnswerSeq]:
    """Greedy answers with selfspec's autoregressive engine (the fast path, lossless to HF generate)."""
    decoder = Decoder(backbone, None)
    cfg = DecodeConfig(strategy="autoregressive", max_new_tokens=max_new_tokens)
    tok = renderer.tokenizer
    eos = set(eos_ids)
    out: list[AnswerSeq] = []
    for i, item in enumerate(items):
        texts: list[str] = []
        for t in range(len(item.turns)):
            ids, _ = renderer.render(item.turns, texts)
            new, _ = decoder.generate(ids, cfg, eos_ids)
            extra: list[int] = []
            room = backbone.max_positions - len(ids) - len(new)
            if new and new[-1] in eos and overhang and room > 0:
                more = DecodeConfig(strategy="autoregressive", max_new_tokens=min(overhang, room))
                extra, _ = decoder.generate(ids + new, more, ())  # no EOS stop: what follows it
            out.append(AnswerSeq(item.id, item.category, t, list(ids), list(new), list(extra)))
            texts.append(tok.decode(new, skip_special_tokens=True))
        if progress is not None:
            progress(i + 1, len(items))
    return out


def load_or_generate(model, renderer, items, max_new_tokens: int, directory: str | os.PathLike | None = None,
                     overhang: int = OVERHANG, progress=None, eos_ids: list[int] | None = None) -> tuple[list[AnswerSeq], Path, bool]:
    """-> (answers, cache file, whether it came from the cache). `model` is a SelfSpecModel."""
    bb = model.backbone
    eos_ids = list(model.eos_ids if eos_ids is None else eos_ids)
    first = [renderer.render(it.turns, [])[0] for it in items]
    key = cache_key(bb.fingerprint(), items, first, max_new_tokens, eos_ids, overhang)
    name = safe_name(model.model_config.name if model.model_config else "model")
    path = (Path(directory).expanduser() if directory else default_dir()) / f"{name}-{key}.json"
    if path.is_file():
        seqs = _read(path, key)
        if seqs is not None:
            return seqs, path, True
    seqs = generate_answers(bb, renderer, items, max_new_tokens, eos_ids, overhang, progress)
    _write(path, key, seqs)
    return seqs, path, False
