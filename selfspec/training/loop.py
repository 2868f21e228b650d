"""The training loop: AdamW, warmup + cosine, gradient accumulation and clipping, data parallel over ranks
(DistributedDataParallel over the trainable parameters; distributed.py).

It does no I/O. It decides *when* to log, validate and checkpoint, and calls a `Hooks` object that the
entry point supplies to decide *how* (W&B, files); `fit` returns the final metrics.

Four ways to feed a head, by what it needs:
  positions  medusa / lens-like heads see one position at a time: gather the cached layer-E hidden states
             of the response positions of a batch of sequences, (N, H), and run the head on them
  sequence   the adapter attends over earlier positions: right-padded cached hidden states (B, T, H)
  ids        heads that change layers < E (LoRA, a trained low-bit draft): run them from token ids as the head drafts
             them (head.early_states), (B, T) -> (B, T, H)
  context    the context head reads the verified context: right-padded layer-E AND final-layer states (B, T, H)
             each; training-time test (heads/context.py: train_steps) gives one output per draft step j, and step
             j's loss (weighed ttt_decay^(j-1)) counts the positions t >= j-1 of each sequence
"""

from __future__ import annotations

import math
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as nn_f
from tqdm.auto import tqdm

from selfspec.errors import SelfSpecError, check
from selfspec.training import checkpoint as ckpt
from selfspec.training.config import TrainerConfig
from selfspec.training.sequences import Sequences
from selfspec.training.distributed import DistInfo, all_reduce_sum_, barrier, data_parallel
from selfspec.training.loss import distill_loss, loss_counts, to_draft_vocab, vocab_index
from selfspec.utils.tensors import right_pad


class Hooks:
    """What the loop calls; the default does nothing (non-zero ranks, tests)."""

    def log(self, step: int, metrics: dict) -> None: ...

    def validate(self, step: int) -> dict:
        return {}

    def checkpoint(self, step: int, state: dict) -> None: ...


@dataclass
class TrainResult:
    step: int  # optimizer steps done (resumed ones included)
    stopped: bool  # stopped early by trainer.stop_after (a checkpoint was written; no final validation)
    train_time_s: float  # time in training steps, this process (validation and checkpoints excluded)
    metrics: dict = field(default_factory=dict)  # the last train/* and the final val/* metrics


class WarmupCosine:
    """lr factor: linear warmup to 1, then cosine down to min_ratio at total steps. A callable object (not a
    lambda) so that LambdaLR's state_dict saves and restores it."""

    def __init__(self, warmup: int, total: int, min_ratio: float):
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def trainable_parameters(head) -> dict[str, torch.nn.Parameter]:
    """The parameters training may change: the head's own, or the LoRA matrices inside the frozen model."""
    params = head.trainable_parameters()
    for p in params.values():
        p.requires_grad_(True)
    return params


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def training_pool(data: Sequences, train_tokens: int | None, seed: int) -> torch.Tensor:
    """Indices of the sequences to train on: all, or (trainer.train_tokens, for data-scaling curves) a seeded
    random subset, taken whole, until it holds at least train_tokens answer tokens."""
    n = data.num_sequences
    if train_tokens is None:
        return torch.arange(n)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + 17))
    per_seq = (data.resp_offsets[1:] - data.resp_offsets[:-1])[order]
    take = int(torch.searchsorted(per_seq.cumsum(0), torch.tensor(train_tokens))) + 1
    return order[: min(take, n)].sort().values


class Trainer:
    def __init__(self, backbone, head, data: Sequences, hidden: torch.Tensor | None, cfg: TrainerConfig,
                 dist: DistInfo = DistInfo(), progress: bool = True, final: torch.Tensor | None = None):
        """hidden: the cached layer-E states (S, H) of every token (features.py); final: the same at E = L (the
        full-depth states), for heads that read the context (training_input "context")."""
        self.bb, self.head, self.data, self.hidden, self.cfg, self.dist = backbone, head, data, hidden, cfg, dist
        self.final = final
        self.progress = progress and dist.is_main
        self.params = trainable_parameters(head)
        check(len(self.params) > 0, f"head.type={head.config.type}: has no parameters to train (the logit lens is the untrained baseline)")
        # Under torchrun: DDP starts every replica from rank 0's values and averages the gradients (None alone).
        self.ddp = data_parallel(self.params.values(), dist, backbone.device)
        check(cfg.batch_size >= dist.world_size, f"trainer.batch_size={cfg.batch_size}: must be >= the number of processes ({dist.world_size})")
        self.mode = head.training_input  # "positions" | "sequence" | "ids" | "context" (see the module docstring)
        if self.mode != "ids" and hidden is None:
            raise SelfSpecError(f"head.type={head.config.type}: training needs the cached layer-E hidden states")
        if self.mode == "context" and final is None:
            raise SelfSpecError(f"head.type={head.config.type}: training needs the cached final-layer states")
        dev = backbone.device
        self.autocast = cfg.precision == "bf16" and dev.type == "cuda"
        # Per target row r: where it is predicted from, the token that followed, rows left in its sequence.
        self.positions = data.target_positions()  # (R,)
        self.labels = data.labels()  # (R,)
        self.rows_left = data.rows_left()  # (R,)
        seq_of_row = torch.repeat_interleave(torch.arange(data.num_sequences), data.resp_offsets[1:] - data.resp_offsets[:-1])
        self.row_pos = self.positions - data.seq_offsets[:-1][seq_of_row]  # (R,) position within its sequence
        # metrics beside loss, soft, hard, acc: context heads' top-1 agreement at each training-time-test step
        self.step_keys = [f"acc_step{j}" for j in range(1, head.ttt_steps + 1)] if self.mode == "context" else []
        self.index = vocab_index(head.vocab_ids, backbone.vocab_size)  # (V,) or None
        self.opt = torch.optim.AdamW(self.params.values(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, WarmupCosine(cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio))
        self.step = 0
        self._perms: dict[int, torch.Tensor] = {}
        self.pool = training_pool(data, cfg.train_tokens, cfg.seed)  # the sequences training draws from

    # ---------------------------------------------------------------- data order
    def batch_sequences(self, micro: int) -> list[int]:
        """This rank's sequences of global micro-batch `micro`: those it owns (sequence b is rank b % W's, whose
        layer-E states it holds)."""
        return [b for b in self.global_batch(micro) if self.dist.owns(b)]

    def global_batch(self, micro: int) -> list[int]:
        """Every rank's sequences of global micro-batch `micro`. The order is a function of (seed, epoch) only,
        so a resumed run sees exactly the batches the interrupted one would have, whatever the number of ranks."""
        n, B = len(self.pool), self.cfg.batch_size
        out = []
        for p in range(micro * B, (micro + 1) * B):  # p: position in the endless stream of shuffled epochs
            epoch = p // n
            if epoch not in self._perms:
                g = torch.Generator().manual_seed(self.cfg.seed * 100_003 + epoch)
                self._perms = {e: v for e, v in self._perms.items() if e >= epoch - 1}  # a batch spans <= 2 epochs
                self._perms[epoch] = torch.randperm(n, generator=g)
            out.append(int(self.pool[self._perms[epoch][p % n]]))
        return out

    # ---------------------------------------------------------------- forward
    def _head_outputs(self, seqs: list[int]) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """-> (x (N, H) head outputs before the final norm, extra-head logits [(N, V')], target rows (N,))."""
        bb, head, d = self.bb, self.head, self.data
        rows = self._rows(seqs)  # (N,)
        if self.mode == "positions":
            h = self.hidden[self.positions[rows]].to(device=bb.device, dtype=bb.dtype)[None]  # (1, N, H)
            return head.transform(h, bb)[0], [lg[0] for lg in head.extra_logits(h, bb)], rows
        # sequence / ids: whole right-padded sequences; then pick each response position (b, t)
        bi, ti = self._sequence_index(seqs, rows)
        if self.mode == "sequence":
            x = head.transform(self._padded(self.hidden, seqs), bb)  # (B, T, H); causal, so right padding is never seen
        else:
            ids = right_pad([d.sequence(b).tolist() for b in seqs], 0).to(bb.device)  # (B, T)
            x = head.transform(head.early_states(bb, ids), bb)  # (B, T, H)
        return x[bi.to(x.device), ti.to(x.device)], [], rows

    def _sequence_index(self, seqs: list[int], rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target rows of sequences `seqs` -> (their sequence's index in seqs (N,), their position in it (N,))."""
        d = self.data
        bi = torch.cat([torch.full((int(d.resp_offsets[b + 1] - d.resp_offsets[b]),), i) for i, b in enumerate(seqs)])
        return bi, self.row_pos[rows]

    def _padded(self, states, seqs: list[int]) -> torch.Tensor:
        """Cached per-token states (S, W) of sequences `seqs` -> (B, T, W) right-padded with zeros, on the device
        (W: the hidden size, or k of them side by side: a context head's fused depths)."""
        d, bb = self.data, self.bb
        lengths = [int(d.seq_offsets[b + 1] - d.seq_offsets[b]) for b in seqs]
        out = torch.zeros(len(seqs), max(lengths), states.shape[-1], dtype=bb.dtype)
        for i, b in enumerate(seqs):
            out[i, : lengths[i]] = states[d.seq_offsets[b] : d.seq_offsets[b + 1]].to(bb.dtype)
        return out.to(bb.device)

    def _context_loss(self, seqs: list[int], whole: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Training-time test (module docstring): step j's logits at position t (t >= j-1) against the target's
        distribution there, weighed ttt_decay^(j-1); plus head.feature_loss x smooth L1 of f̂ on f, weighed alike.
        Stats: step 1's soft / hard / acc, and every step's acc (acc_step<j>)."""
        bb, head, d, cfg, hc = self.bb, self.head, self.data, self.cfg, self.head.config
        dev = bb.device
        rows = self._rows(seqs)
        bi, ti = self._sequence_index(seqs, rows)
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=self.autocast):
            final = self._padded(self.final, seqs)  # (B, T, k*H): the states at the head's context depths
            steps = head.train_steps(self._padded(self.hidden, seqs), final, bb)  # [(B, T, H)] per step
            b, t = bi.to(dev), ti.to(dev)
            xs = [x[b, t] for x in steps]  # (N, H) each: f̂ at the target rows
            logits = [bb.logits(bb.norm(x), head.lm_weight(bb)) for x in xs]
        real = final[b, t, -bb.hidden_size:].float()  # (N, H) the final layer's state at the target rows
        _, ids, labels = self._head_targets(rows, 0)
        total, stats = None, {}
        for j, lg in enumerate(logits):  # step j+1 read j predicted features: rows at t >= j have such a round
            ok = ti >= j
            okd = ok.to(dev)
            counts, n = None, int(ok.sum())
            if whole is not None:  # the whole micro-batch's counts (a data-parallel rank's share)
                w_ok = self.row_pos[whole] >= j
                counts, n = loss_counts(*self._head_targets(whole[w_ok], 0)[1:]), int(w_ok.sum())
            loss, st = distill_loss(lg[okd], ids[ok].to(dev), d.topk_logprobs[rows[ok]].to(dev), labels[ok].to(dev),
                                    cfg.distill_temperature, cfg.hard_weight, counts)
            if hc.feature_loss:  # mean over rows and features
                reg = nn_f.smooth_l1_loss(xs[j][okd].float(), real[okd], reduction="sum") / (max(n, 1) * bb.hidden_size)
                loss = loss + hc.feature_loss * reg
            weighted = loss * hc.ttt_decay**j
            total = weighted if total is None else total + weighted
            if j == 0:
                stats = dict(st)
            stats[f"acc_step{j + 1}"] = st["acc"]
        return total, stats

    def _rows(self, seqs: list[int]) -> torch.Tensor:
        d = self.data
        return torch.cat([torch.arange(d.resp_offsets[b], d.resp_offsets[b + 1]) for b in seqs])

    def _head_targets(self, rows: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Head i's targets for target rows `rows`: (which rows it may use, top-k ids and labels in the draft vocabulary)."""
        ok = self.rows_left[rows] >= i  # (N,) head i needs a token i further on in the same sequence
        tgt = rows[ok] + i
        return ok, to_draft_vocab(self.data.topk_ids[tgt], self.index), to_draft_vocab(self.labels[tgt], self.index)

    def micro_batch_loss(self, seqs: list[int], batch: list[int] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of sequences `seqs`. With `batch` (the whole global micro-batch, seqs being this rank's part of
        it), each mean is over the whole batch's rows, so the ranks' losses add up to the one-process loss."""
        bb, head, d, cfg = self.bb, self.head, self.data, self.cfg
        dev = bb.device
        if not seqs:  # none of this micro-batch's sequences is this rank's: zero gradients, but DDP's all-reduce runs
            zero = sum(p.sum() for p in self.params.values()) * 0.0
            return zero, {k: zero.detach() for k in ("soft", "hard", "acc", *self.step_keys)}
        whole = self._rows(batch) if batch is not None else None
        if self.mode == "context":
            return self._context_loss(seqs, whole)
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=self.autocast):
            x, extra, rows = self._head_outputs(seqs)
            logits = [bb.logits(bb.norm(x), head.lm_weight(bb)), *extra]  # head i: (N, V'), predicts row r + i
        total, stats = None, {}
        for i, lg in enumerate(logits):
            ok, ids, labels = self._head_targets(rows, i)
            counts = loss_counts(*self._head_targets(whole, i)[1:]) if whole is not None else None
            loss, st = distill_loss(
                lg[ok.to(dev)],
                ids.to(dev),
                d.topk_logprobs[rows[ok] + i].to(dev),
                labels.to(dev),
                cfg.distill_temperature, cfg.hard_weight, counts,
            )
            weighted = loss * cfg.extra_head_decay**i
            total = weighted if total is None else total + weighted
            if i == 0:
                stats = st
        return total, stats

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "params": {n: p.detach().cpu().clone() for n, p in self.params.items()},
            "vocab_ids": self.head.vocab_ids.cpu().clone(),
            "head_config": self.head.config_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "rng": ckpt.rng_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        saved, mine = state["head_config"], self.head.config_dict()
        for key in ("type", "exit_layer", "num_blocks", "num_heads", "intermediate", "lora_rank", "context_layers", "mlp_ratio",
                    "draft_precision", "lowbit_targets"):
            if key in mine and saved.get(key) != mine[key]:  # a head type has only its own keys
                raise SelfSpecError(f"trainer.resume: the checkpoint has head.{key}={saved.get(key)!r}, this run head.{key}={mine.get(key)!r}")
        if set(state["params"]) != set(self.params):
            raise SelfSpecError("trainer.resume: the checkpoint's parameters do not match this head")
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(state["params"][n].to(p.device, p.dtype))
        self.head.set_draft_vocab(state["vocab_ids"] if state["vocab_ids"].numel() else None)
        self.index = vocab_index(self.head.vocab_ids, self.bb.vocab_size)
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        ckpt.set_rng_state(state["rng"])
        self.step = int(state["step"])

    # ---------------------------------------------------------------- loop
    def _backward(self, micro: int, last: bool) -> torch.Tensor:
        """Loss and gradients of global micro-batch `micro` -> its (loss, soft, hard, acc, *step_keys) on this rank. Under DDP each
        rank's loss is its share of the micro-batch's mean (micro_batch_loss(seqs, batch)); DDP averages the ranks'
        gradients, so the loss is scaled by W; gradients are all-reduced at the last micro-batch of the step only."""
        W = self.dist.world_size
        batch = self.global_batch(micro)
        seqs = [b for b in batch if self.dist.owns(b)]
        if self.ddp is None:
            loss, st = self.micro_batch_loss(seqs)
            (loss / self.cfg.grad_accum).backward()
        else:
            with nullcontext() if last else self.ddp.no_sync():
                loss, st = self.ddp(self.micro_batch_loss, seqs, batch)
                (loss * W / self.cfg.grad_accum).backward()
        return torch.stack([loss.detach().float().cpu(), *(st[k].float().cpu() for k in ("soft", "hard", "acc", *self.step_keys))])

    def _check_finite(self, loss: float, grad_norm: float) -> None:
        """Stop at the first NaN / inf loss or gradient, before it reaches the weights: every rank sees the same
        synced values, so all stop together; nothing is checkpointed or saved from here (a NaN head would draft
        garbage and crash sampling)."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return
        bad = f"the loss is {loss}" if not math.isfinite(loss) else f"the gradient norm is {grad_norm}"
        raise SelfSpecError(f"training: {bad} at step {self.step + 1}; stopped before it reached the weights (the last "
                            f"checkpoint, if any, is sound; no head saved); lower trainer.lr (now {self.cfg.lr}) or check the data")

    def _main_only(self, fn, *args):
        """Run a hook on rank 0 while the others wait for it."""
        out = fn(*args) if self.dist.is_main else {}
        barrier(self.dist)
        return out

    def fit(self, hooks: Hooks | None = None) -> TrainResult:
        hooks, cfg = hooks or Hooks(), self.cfg
        self.head.train()
        train_time = 0.0
        last_train: dict = {}
        last_ckpt = self.step
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="training", unit="step", disable=not self.progress)
        while self.step < cfg.max_steps:
            t0 = time.perf_counter()
            self.opt.zero_grad(set_to_none=True)
            sums = torch.zeros(4 + len(self.step_keys))  # loss, soft, hard, acc, *step_keys
            for m in range(cfg.grad_accum):
                sums += self._backward(self.step * cfg.grad_accum + m, m == cfg.grad_accum - 1) / cfg.grad_accum
            sums = all_reduce_sum_(self.dist, sums)  # each rank's share of the means: their sum is the whole batch's
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params.values(), cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
            self._check_finite(float(sums[0]), float(grad_norm))  # before the step: the weights are still sound
            lr = self.sched.get_last_lr()[0]
            self.opt.step()
            self.sched.step()
            self.step += 1
            train_time += time.perf_counter() - t0
            loss_v, soft_v, hard_v, acc_v, *step_v = sums.tolist()
            last_train = {"train/loss": loss_v, "train/soft": soft_v, "train/hard": hard_v, "train/acc": acc_v,
                          "train/lr": lr, "train/grad_norm": float(grad_norm),
                          **{f"train/{k}": v for k, v in zip(self.step_keys, step_v)}}
            bar.update(1)
            bar.set_postfix(loss=f"{loss_v:.3f}", acc=f"{acc_v:.3f}")
            if self.step % cfg.log_every == 0 or self.step == cfg.max_steps:
                self._main_only(hooks.log, self.step, last_train)
            if cfg.val_every and self.step % cfg.val_every == 0 and self.step < cfg.max_steps:
                self._main_only(hooks.validate, self.step)
            if cfg.ckpt_every and self.step % cfg.ckpt_every == 0:
                self._main_only(hooks.checkpoint, self.step, self.state_dict())
                last_ckpt = self.step
            if cfg.stop_after and self.step >= cfg.stop_after and self.step < cfg.max_steps:
                if last_ckpt != self.step:
                    self._main_only(hooks.checkpoint, self.step, self.state_dict())
                bar.close()
                return TrainResult(self.step, True, train_time, dict(last_train))
        bar.close()
        if cfg.ckpt_every and last_ckpt != self.step:  # the final state too: resuming a finished run is a no-op
            self._main_only(hooks.checkpoint, self.step, self.state_dict())
        val = self._main_only(hooks.validate, self.step)
        return TrainResult(self.step, False, train_time, {**last_train, **val})
