"""Teacher-forced labels and features of given token sequences: one prefill each, kept in resumable shards.

One pass of the target over a batch of right-padded sequences gives, at every position t < T-1 of each, its top-k
next-token ids and log-probabilities, and the hidden states after each layer E of `layers` (E = L: the last
layer's output, before the final norm). That is all a head's training reads (sequences.Sequences and the
`hidden-E<E>-<dtype>.pt` files of features.py), so nothing is recomputed.

A `ShardPool` keeps them in blocks of `shard_size` consecutive items of a stream (items are keyed by their
stream index, so every consumer of a prefix of the stream shares the blocks), in one directory:
  shard-<s>.pt               block s: its items' stream indices and token ids, the top-k of every position
  shard-<s>-E<E>-<dtype>.pt  their layer-E states, one row per token
  *.sum                      size + checksum of each (selfspec.utils.io), written with it
Each file is written atomically as its block finishes, so an interrupted extraction loses at most one block and a
rerun continues; a damaged file, or one made from other token ids (another tokenizer), is recomputed with one
warning line. A block's file may hold more items than a consumer asks for (they are skipped), never fewer.
Under torchrun (distributed.sharding) rank r extracts the blocks s with s % W == r, then all ranks wait.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from selfspec.errors import SelfSpecError
from selfspec.training import distributed
from selfspec.utils.io import atomic_write, checksum_problem, file_lock
from selfspec.utils.tensors import right_pad, safe_torch_load

log = logging.getLogger(__name__)

FORMAT = "selfspec-teacher-shard/1"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
LOGIT_ROWS = 512  # positions per LM-head chunk: (512, V) float32 logits at a time


@dataclass(frozen=True)
class Item:
    index: int  # its position in the stream
    ids: tuple[int, ...]


# ------------------------------------------------------------------------------------------------ the pass
def _cast(h: torch.Tensor, dtype: torch.dtype, layer: int) -> torch.Tensor:
    out = h.to(dtype).cpu()
    if not torch.isfinite(out).all():
        raise SelfSpecError(f"data.feature_dtype={str(dtype).removeprefix('torch.')}: layer-{layer} hidden states overflow "
                            "it; use data.feature_dtype=bfloat16 or float32")
    return out


@torch.inference_mode()
def teacher_pass(backbone, seqs: list[list[int]], layers: list[int], topk: int | None,
                 dtype: torch.dtype) -> list[tuple[torch.Tensor | None, torch.Tensor | None, dict[int, torch.Tensor]]]:
    """One prefill of `seqs` (right-padded: with causal attention no real position sees a later pad) ->
    per sequence (top-k ids (T-1, k), their log-probabilities (T-1, k), {E: (T, H) states in `dtype`}); the
    top-k are None when topk is None (then only layers up to max(layers) run)."""
    bb = backbone
    ids = right_pad(seqs, 0).to(bb.device)  # (B, T)
    h = bb.embed(ids)  # (B, T, H)
    states: dict[int, torch.Tensor] = {}
    start = 0
    for end in sorted(set(layers) | ({bb.num_layers} if topk else set())):
        h = bb.run_layers(h, start, end)  # a new tensor: the states kept below stay as they are
        start = end
        if end in layers:
            states[end] = h
    out = []
    for r, seq in enumerate(seqs):
        T = len(seq)
        feats = {E: _cast(s[r, :T], dtype, E) for E, s in states.items()}
        if not topk:
            out.append((None, None, feats))
            continue
        ids_r, lp_r = [], []
        for a in range(0, T - 1, LOGIT_ROWS):  # position t predicts token t + 1; the last one predicts nothing here
            logp = bb.logits(bb.norm(h[r, a : min(a + LOGIT_ROWS, T - 1)])).float().log_softmax(-1)  # (n, V)
            top = logp.topk(topk, dim=-1)
            ids_r.append(top.indices.cpu())
            lp_r.append(top.values.cpu())
        k = min(topk, bb.vocab_size)
        out.append((torch.cat(ids_r) if ids_r else torch.empty(0, k, dtype=torch.long),
                    torch.cat(lp_r) if lp_r else torch.empty(0, k), feats))
    return out


def batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped by similar length (less padding), each group's padded size B x T_max <= batch_tokens (a
    longer sequence goes alone)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[i] <= batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


# ------------------------------------------------------------------------------------------------ the pool
class ShardPool:
    """Blocks of a stream's teacher-forced labels and features (see the module docstring). directory None keeps
    them in memory (nothing resumes)."""

    def __init__(self, directory: Path | None, digest: str, shard_size: int):
        self.directory = Path(directory) if directory is not None else None
        self.digest, self.shard_size = digest, shard_size
        self._memory: dict[str, dict] = {}

    def block(self, index: int) -> int:
        return index // self.shard_size

    def _name(self, s: int, layer: int | None = None, dtype_name: str | None = None) -> str:
        return f"shard-{s:05d}.pt" if layer is None else f"shard-{s:05d}-E{layer}-{dtype_name}.pt"

    def _save(self, name: str, payload: dict) -> None:
        if self.directory is None:
            self._memory[name] = payload
        else:
            atomic_write(self.directory / name, lambda f: torch.save(payload, f), checksum=True)

    def _load(self, name: str) -> dict | None:
        """The payload of `name` when it is sound and this pool's (else None, with one warning when damaged)."""
        if self.directory is None:
            return self._memory.get(name)
        path = self.directory / name
        if not path.is_file():
            return None
        problem = checksum_problem(path)
        payload = None
        if problem is None:
            try:
                payload = safe_torch_load(path)
            except SelfSpecError:  # an unsafe torch: no file is read
                raise
            except Exception as exc:  # matches its checksum but not torch's format
                problem = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if payload is not None and not (isinstance(payload, dict) and payload.get("format") == FORMAT):
            problem = "not a teacher shard"
        if problem is not None:
            log.warning("teacher shard %s is damaged (%s); computing it again", path, problem)
            return None
        return payload if payload.get("digest") == self.digest else None

    # ---------------------------------------------------------------- reading
    def targets(self, s: int, items: list[Item] | None = None) -> dict | None:
        """Block s's labels: {"index" (m,), "lengths" (m,), "tokens" (S,), "topk_ids" (S-m, k), "topk_logprobs"},
        or None when missing, damaged, or (items given) not holding every one of `items` with the same ids."""
        d = self._load(self._name(s))
        if d is None or items is None:
            return d
        rows = _rows(d)
        for it in items:
            if it.index not in rows or d["tokens"][rows[it.index][0] : rows[it.index][1]].tolist() != list(it.ids):
                if it.index in rows:
                    log.warning("teacher shard %d holds other token ids for item %d (another tokenizer?); computing it again",
                                s, it.index)
                return None
        return d

    def hidden(self, s: int, layer: int, dtype_name: str, index: torch.Tensor) -> torch.Tensor | None:
        """Block s's layer-E states ((S, H), rows as its targets' tokens) when sound and made for `index`."""
        d = self._load(self._name(s, layer, dtype_name))
        if d is None or not torch.equal(d["index"], index) or d["hidden"].dtype != DTYPES[dtype_name]:
            return None
        return d["hidden"]

    def items_of(self, s: int) -> list[Item] | None:
        """The items block s's labels were made from."""
        d = self._load(self._name(s))
        if d is None:
            return None
        return [Item(i, tuple(d["tokens"][a:b].tolist())) for i, (a, b) in _rows(d).items()]

    # ---------------------------------------------------------------- extraction
    def fill(self, backbone, blocks: dict[int, list[Item]], layers: list[int], dtype_name: str, topk: int | None,
             batch_tokens: int = 4096, progress: bool = True) -> dict:
        """Compute what blocks lack: the labels (topk given) of a block missing them or some of its items, and
        the layer-E states of `layers`. Under distributed.sharding this rank does its blocks only (s % W == r),
        then waits for the others. -> {"tokens": tokens passed through the model, "seconds": their time}."""
        shard = distributed.current_shard()
        mine = {s: v for s, v in sorted(blocks.items()) if shard is None or s % shard.world_size == shard.rank}
        dtype = DTYPES[dtype_name]
        done = {"tokens": 0, "seconds": 0.0}
        todo = sum(len(it.ids) for v in mine.values() for it in v)
        bar = tqdm(total=todo, desc="teacher-forced pass", unit="tok", unit_scale=True, disable=not progress)
        for s, items in mine.items():
            with file_lock(self.directory / f".{self._name(s)}.lock") if self.directory is not None else contextlib.nullcontext():
                t0 = time.perf_counter()
                ran = self._fill_block(backbone, s, items, layers, dtype_name, dtype, topk, batch_tokens)
                bar.update(sum(len(it.ids) for it in items))
                if ran:
                    dt = time.perf_counter() - t0
                    done["tokens"] += ran
                    done["seconds"] += dt
                    log.info("teacher shard %d done: %d items, %d tokens, %.0f tokens/s", s, len(items), ran, ran / max(dt, 1e-9))
        bar.close()
        if shard is not None:
            distributed.barrier(shard)
        return done

    def _fill_block(self, bb, s: int, items: list[Item], layers: list[int], dtype_name: str, dtype: torch.dtype,
                    topk: int | None, batch_tokens: int) -> int:
        """-> the tokens run through the model for block s (0: it was complete)."""
        d = self.targets(s, items)
        if d is None and not topk:
            raise SelfSpecError(f"teacher shard {s}: its labels are missing; they are needed before its features")
        if d is not None:  # the items the file holds: its features are made for exactly those
            items = self.items_of(s)
        want = [E for E in layers if d is None or self.hidden(s, E, dtype_name, d["index"]) is None]
        if d is not None and not want:
            return 0
        items = sorted(items, key=lambda it: it.index)
        results: list = [None] * len(items)
        for group in batches([len(it.ids) for it in items], batch_tokens):
            for i, r in zip(group, teacher_pass(bb, [list(items[i].ids) for i in group], want, topk if d is None else None, dtype)):
                results[i] = r
        index = torch.tensor([it.index for it in items], dtype=torch.long)
        if d is None:
            self._save(self._name(s), {
                "format": FORMAT, "digest": self.digest, "index": index,
                "lengths": torch.tensor([len(it.ids) for it in items], dtype=torch.long),
                "tokens": torch.tensor([t for it in items for t in it.ids], dtype=torch.int32),
                "topk_ids": torch.cat([r[0] for r in results]).int(),
                "topk_logprobs": torch.cat([r[1] for r in results]).clamp(min=-60).half(),  # as dataset.pt keeps them
            })
        for E in want:
            self._save(self._name(s, E, dtype_name), {
                "format": FORMAT, "digest": self.digest, "index": index, "hidden": torch.cat([r[2][E] for r in results])})
        return sum(len(it.ids) for it in items)

    # ---------------------------------------------------------------- assembly
    def gather_targets(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per stream index: (token ids (T,), top-k ids (T-1, k), their log-probabilities (T-1, k)); every block
        must hold them (fill first)."""
        out = []
        cache: dict[int, tuple[dict, dict]] = {}
        for i in indices:
            s = self.block(i)
            if s not in cache:
                cache.clear()  # items come in stream order: one block at a time in memory
                d = self.targets(s)
                if d is None:
                    raise SelfSpecError(f"teacher shard {s} is missing or damaged (rebuild the dataset)")
                cache[s] = (d, _rows(d))
            d, rows = cache[s]
            a, b = rows[i]
            r0 = a - rows_before(d, i)
            out.append((d["tokens"][a:b].long(), d["topk_ids"][r0 : r0 + b - a - 1].long(),
                        d["topk_logprobs"][r0 : r0 + b - a - 1].float()))
        return out

    def gather_hidden(self, indices: list[int], layer: int, dtype_name: str, hidden_size: int) -> torch.Tensor | None:
        """(sum of the items' lengths, H) layer-E states of the items, one after another; None when a block lacks them."""
        spans, rows_of = [], {}  # (block, start, end) per item; block -> (its rows, its index)
        for i in indices:
            s = self.block(i)
            if s not in rows_of:
                d = self.targets(s)
                if d is None:
                    return None
                rows_of[s] = (_rows(d), d["index"])
            if i not in rows_of[s][0]:
                return None
            spans.append((s, *rows_of[s][0][i]))
        out = torch.empty(sum(b - a for _, a, b in spans), hidden_size, dtype=DTYPES[dtype_name])
        row, held = 0, (None, None)
        for s, a, b in spans:
            if held[0] != s:  # items come in stream order: one block's states in memory at a time
                held = (s, self.hidden(s, layer, dtype_name, rows_of[s][1]))
                if held[1] is None:
                    return None
            out[row : row + b - a] = held[1][a:b]
            row += b - a
        return out


def _rows(d: dict) -> dict[int, tuple[int, int]]:
    """stream index -> (start, end) of its tokens in the block's `tokens`."""
    ends = d["lengths"].cumsum(0).tolist()
    starts = [0, *ends[:-1]]
    return {int(i): (a, b) for i, a, b in zip(d["index"].tolist(), starts, ends)}


def rows_before(d: dict, index: int) -> int:
    """How many items come before `index` in its block (each item has one row fewer of top-k than tokens)."""
    return int((d["index"] < index).sum())


# ------------------------------------------------------------------------------------------------ features
def pooled_hidden(backbone, data, directory, exit_layer: int, dtype_name: str, progress: bool = True) -> torch.Tensor | None:
    """The (S, H) layer-E states of a dataset built from a ShardPool (its meta["pool"]: data=sharegpt), from the
    pool's blocks; a block without them gets them now (layers 0..E only, resumable like the labels). None for
    other datasets, or when the pool is gone or no longer matches (then features.py computes them as usual)."""
    info = data.meta.get("pool") if isinstance(data.meta, dict) else None
    if not info or directory is None:
        return None
    pool = ShardPool(Path(directory).parent / info["dir"], info["digest"], int(info["shard_size"]))
    indices = [int(i) for i in info["items"]]
    blocks: dict[int, list[Item]] = {}
    for s in sorted({pool.block(i) for i in indices}):
        items = pool.items_of(s)
        if items is None:
            log.warning("data: teacher shard %d of %s is gone; computing the layer-%d states from the dataset", s, pool.directory, exit_layer)
            return None
        blocks[s] = items
    pool.fill(backbone, blocks, [exit_layer], dtype_name, None, progress=progress)
    h = pool.gather_hidden(indices, exit_layer, dtype_name, backbone.hidden_size)
    if h is None or h.shape[0] != data.tokens.numel():
        return None
    return h
