"""What a training dataset holds (`Sequences`: token ids and the full model's soft targets) and the files of its
directory that every builder writes: dataset.pt (`Sequences.save`, through `atomic_torch_save`: atomic, with a
checksum) and the layer-E states (`hidden_path` names them).

Below the builders (dataset.py's selfgen and jsonl, mix/build.py, sharegpt.py) and features.py, which all use it;
dataset.py caches the result (keys, locks, rebuilding what is damaged)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from selfspec.errors import check
from selfspec.utils.io import atomic_write
from selfspec.utils.tensors import safe_torch_load

FORMAT = "selfspec-distill/1"


@dataclass
class Sequences:
    """n sequences (chat-encoded prompt + response) and soft targets at their R response positions.

    tokens        (S,)   every sequence's ids, concatenated; sequence b is tokens[seq_offsets[b]:seq_offsets[b+1]]
    seq_offsets   (n+1,)
    prompt_lens   (n,)   P_b; the response is the rest of the sequence
    topk_ids      (R, k) the full model's top-k ids at response positions (row j of sequence b is the
                         distribution from position P_b-1+j, which predicts response token j)
    topk_logprobs (R, k) their log-probabilities
    resp_offsets  (n+1,) sequence b's target rows are resp_offsets[b]:resp_offsets[b+1]
    """

    tokens: torch.Tensor
    seq_offsets: torch.Tensor
    prompt_lens: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    resp_offsets: torch.Tensor
    val_prompts: list[str]
    train_prompts: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    @classmethod
    def from_pairs(cls, pairs: list[tuple[list[int], list[int]]], targets: list[tuple[torch.Tensor, torch.Tensor]],
                   val_prompts: list[str], train_prompts: list[str], meta: dict) -> "Sequences":
        """pairs: (prompt ids, response ids); targets: (top-k ids (n, k), logprobs (n, k)) per response."""
        keep = [i for i, (_, r) in enumerate(pairs) if len(r) > 0]
        check(len(keep) > 0, "data: no usable training sequences (every response is empty)")
        pairs = [pairs[i] for i in keep]
        targets = [targets[i] for i in keep]
        lengths = torch.tensor([len(p) + len(r) for p, r in pairs])
        resp_lengths = torch.tensor([len(r) for _, r in pairs])
        return cls(
            tokens=torch.tensor([t for p, r in pairs for t in p + r], dtype=torch.long),
            seq_offsets=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
            prompt_lens=torch.tensor([len(p) for p, _ in pairs], dtype=torch.long),
            topk_ids=torch.cat([t[0] for t in targets]).long(),
            topk_logprobs=torch.cat([t[1] for t in targets]).float(),
            resp_offsets=torch.cat([torch.zeros(1, dtype=torch.long), resp_lengths.cumsum(0)]),
            val_prompts=list(val_prompts),
            train_prompts=[train_prompts[i] for i in keep] if train_prompts else [],
            meta=dict(meta),
        )

    # ---------------------------------------------------------------- views
    @property
    def num_sequences(self) -> int:
        return self.prompt_lens.numel()

    @property
    def num_targets(self) -> int:
        return self.topk_ids.shape[0]

    def sequence(self, b: int) -> torch.Tensor:
        return self.tokens[self.seq_offsets[b] : self.seq_offsets[b + 1]]

    def target_positions(self) -> torch.Tensor:
        """(R,) for each target row, the index into `tokens` of the position it is predicted from."""
        resp = self.resp_offsets[1:] - self.resp_offsets[:-1]  # (n,)
        start = self.seq_offsets[:-1] + self.prompt_lens - 1  # (n,) the last prompt position
        seq_of_row = torch.repeat_interleave(torch.arange(self.num_sequences), resp)  # (R,)
        j = torch.arange(self.num_targets) - self.resp_offsets[:-1][seq_of_row]
        return start[seq_of_row] + j

    def labels(self) -> torch.Tensor:
        """(R,) the token that actually followed each target position (the target's own next token)."""
        return self.tokens[self.target_positions() + 1]

    def rows_left(self) -> torch.Tensor:
        """(R,) how many target rows of the same sequence follow each row (0 for a response's last token):
        a medusa head i may use row r only when rows_left[r] >= i."""
        seq_of_row = torch.repeat_interleave(torch.arange(self.num_sequences), self.resp_offsets[1:] - self.resp_offsets[:-1])
        return self.resp_offsets[1:][seq_of_row] - 1 - torch.arange(self.num_targets)

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """(V,) how often each token occurs in the responses (for the draft vocabulary)."""
        return torch.bincount(self.labels(), minlength=vocab_size)[:vocab_size]

    # ---------------------------------------------------------------- files
    def save(self, path: Path) -> dict:
        """Write the dataset -> the payload written (Sequences.from_payload of it is what a later load gives).
        Compact on disk: ids fit int32, log-probabilities fp16 (the loss needs no more)."""
        payload = {
            "format": FORMAT, "tokens": self.tokens.int(), "seq_offsets": self.seq_offsets,
            "prompt_lens": self.prompt_lens, "topk_ids": self.topk_ids.int(),
            "topk_logprobs": self.topk_logprobs.clamp(min=-60).half(), "resp_offsets": self.resp_offsets,
            "val_prompts": self.val_prompts, "train_prompts": self.train_prompts, "meta": self.meta,
        }
        atomic_torch_save(payload, path)
        return payload

    @classmethod
    def load(cls, path: Path) -> "Sequences":
        return cls.from_payload(safe_torch_load(path), path)

    @classmethod
    def from_payload(cls, d, path: Path) -> "Sequences":
        check(isinstance(d, dict) and d.get("format") == FORMAT, f"{path}: not a selfspec dataset cache (delete it to rebuild)")
        return cls(
            tokens=d["tokens"].long(), seq_offsets=d["seq_offsets"], prompt_lens=d["prompt_lens"],
            topk_ids=d["topk_ids"].long(), topk_logprobs=d["topk_logprobs"].float(), resp_offsets=d["resp_offsets"],
            val_prompts=list(d["val_prompts"]), train_prompts=list(d["train_prompts"]), meta=dict(d["meta"]),
        )


def atomic_torch_save(obj, path: Path) -> None:
    """torch.save atomically (temp file, fsync, rename) with a checksum beside it (see load_checked)."""
    atomic_write(path, lambda f: torch.save(obj, f), checksum=True)


def hidden_path(directory, exit_layer: int, dtype_name: str, part: tuple[int, int] | None = None):
    """The whole dataset's file, or (part = (rank, world), world > 1) a rank's part's."""
    tail = f"-part{part[0]}of{part[1]}" if part is not None and part[1] > 1 else ""
    return directory / f"hidden-E{exit_layer}-{dtype_name}{tail}.pt"
