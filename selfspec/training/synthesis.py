"""Offline self-distillation data: the target writes its own prompts and answers.

Prompts (Magpie, Xu et al. 2024): give the target only its chat template's user-turn prefix and *sample*
what follows until the end-of-turn token: an instruction model then writes a plausible user message.
Answers: the target answers prompts (greedy by default). While it does, the full model's top-k distribution
at every answer position is recorded from the generation itself (the raw logits, before any sampling
warper), so soft targets cost no second forward pass.

Both run through `generate`, a batched decode loop over the Backbone (not HF `generate`):
  - ragged rows: every row of the batch sits at its own length in a KV cache written by position, with its
    own rotary positions and mask (Backbone.run_layers(key_positions=...)), so nothing is left-padded;
  - continuous batching: a row that stops leaves the batch at once (the last row moves into its slot) and
    waiting prompts are prefilled into the free slots, so the batch stays full until the queue is empty;
  - length bucketing: prompts are taken shortest first, and the batch is sized from a token budget
    (rows x cache length), so short prompts run in wide batches and long contexts in narrower ones.
Greedy answers do not depend on which rows share a batch (up to float rounding); sampled rows draw from a
generator seeded per request, so they do not either. `eval/synth_throughput.py` measures this loop against
`answer_prompts_hf`, the HF `generate` path it replaced (left-padded batches that wait for their longest row).

Why not the decoding engine (decoding/engine.py)? It is a batch-1 loop of speculative rounds (draft, verify, accept,
roll back) over a KVCache whose one write position serves the whole batch; synthesis decodes plainly (one token per
step, no drafts), dozens of rows at once, each at its own length, and refills finished rows. What they share is the
model's one adapter: both run `Backbone.run_layers` (here with `key_positions`, its ragged-batch masks) and prefill
through model/cache.py's KVCache; only the ragged decode steps keep their K/V in `_RaggedCache` (one slot per row
at that row's own length), which KVCache's single write position cannot express.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm

from selfspec.errors import check
from selfspec.model.cache import KVCache
from selfspec.model.hf_baselines import generate_with_topk
from selfspec.model.tokens import user_turn_prefix
from selfspec.training.distributed import current_shard, gather_in_order
from selfspec.utils.tensors import right_pad

log = logging.getLogger(__name__)


@dataclass
class Answer:
    response: list[int]  # new tokens, a final end-of-turn token included when the answer finished
    topk_ids: torch.Tensor  # (n, k) the full model's top-k token ids at each response position
    topk_logprobs: torch.Tensor  # (n, k) their log-probabilities (over the full vocabulary)
    finished: bool = True  # False: cut at the token limit


@dataclass(frozen=True)
class BatchSettings:
    """How `generate` packs rows. The KV cache holds max_batch x cache length <= token_budget tokens
    (SmolLM2-135M: 46 KB per token in float32, so the default 24k tokens is ~1.1 GB)."""

    max_batch: int = 64  # rows decoded together (on 2 CPU cores wider batches stop paying at about 64)
    token_budget: int = 24576  # rows x cache length
    prefill_tokens: int = 4096  # rows x prompt length of one prefill chunk

    def __post_init__(self):
        for key in ("max_batch", "token_budget", "prefill_tokens"):
            v = getattr(self, key)
            check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"BatchSettings.{key}={v!r}: must be an integer >= 1")


# ====================================================================================== batched decoding
class _RaggedCache:
    """K/V of a batch whose rows have different lengths: row r's token at position p sits in slot p of row r.
    A decode step writes each row's new K/V at its own length (`lens`) and hands the layer the slots
    [0, span) of the first `rows` rows; Backbone.run_layers masks what a row does not own."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, max_len: int, dtype, device):
        shape = (num_layers, batch, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.batch, self.max_len = batch, max_len
        self.lens = torch.zeros(batch, dtype=torch.long, device=device)  # tokens held per row
        self.rows, self.span = 0, 0  # set by step()
        self.write_pos = 0  # run_layers sets it; unused here (rows write at their own lengths)
        self._where = None

    def step(self, rows: int) -> None:
        """Before a decode step of the first `rows` rows: where each row's K/V go, as rows of a (B*H*M, D) view
        of a layer's buffer (one index_copy_ per layer instead of a slow two-index scatter)."""
        heads, m = self.k.shape[2], self.k.shape[3]
        self.rows, self.span = rows, int(self.lens[:rows].max()) + 1
        r = torch.arange(rows, device=self.lens.device)[:, None]
        h = torch.arange(heads, device=self.lens.device)[None]
        self._where = ((r * heads + h) * m + self.lens[:rows, None]).reshape(-1)  # (rows * H,)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """(rows, H, 1, D) K/V of one decode step -> each row's slot lens[r]; returns (rows, H, span, D)."""
        n, d = key.shape[0], key.shape[-1]
        self.k[layer_idx].view(-1, d).index_copy_(0, self._where, key.reshape(-1, d))
        self.v[layer_idx].view(-1, d).index_copy_(0, self._where, value.reshape(-1, d))
        return self.k[layer_idx, :n, :, : self.span], self.v[layer_idx, :n, :, : self.span]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.span

    @property
    def is_compileable(self) -> bool:
        return False


class _Sampler:
    """Greedy (temperature 0) or temperature + nucleus sampling with one generator per request, on the device the
    logits are on: the (n, V) probabilities never leave it, and each row draws from its request's own generator (so a
    row's sample does not depend on which rows share its batch)."""

    def __init__(self, temperature: float, top_p: float, seed: int):
        self.temperature, self.top_p, self.seed = float(temperature), float(top_p), int(seed)

    def generator(self, request: int, device: torch.device | str = "cpu") -> torch.Generator | None:
        if self.temperature <= 0:
            return None
        return torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + request)

    def __call__(self, logits: torch.Tensor, gens: list) -> torch.Tensor:
        """(n, V) raw logits -> (n,) next tokens, sampled where the logits are."""
        if self.temperature <= 0:
            return logits.argmax(-1)
        probs = (logits.float() / self.temperature).softmax(-1)
        if self.top_p < 1.0:
            sorted_p, order = probs.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > self.top_p  # keep the smallest prefix with mass >= top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        return torch.cat([torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(gens)])


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


SYNTH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def synthesis_backbone(backbone, dtype: str = "float32"):
    """The backbone that writes the data: the target itself (float32), or a bfloat16 copy of it (on CPUs with
    AMX or AVX512-BF16, and GPUs, its matmuls run several times faster; on AVX2-only CPUs slower). With a copy,
    `generate` recomputes the top candidates of every next-token distribution with the target's own float32 LM
    head (see _NextToken), so what remains of the difference is the copy's hidden states. Measured on
    SmolLM2-135M (eval/synth_throughput.py, method ours_bf16, 10k answer tokens): the float32 target's argmax
    is the token the copy wrote at 98.8% of positions, KL(float32 || recorded top-32) 5e-4 nats; greedy
    answers follow the float32 ones until the first such disagreement (35% of 128-token answers identical).
    -> (backbone to generate with, the target's LM head weight or None)."""
    check(dtype in SYNTH_DTYPES, f"data.synth_dtype={dtype!r}: allowed {', '.join(SYNTH_DTYPES)}")
    want = SYNTH_DTYPES[dtype]
    if backbone.dtype == want or want == torch.float32:
        return backbone, None
    return backbone.copy_in(want), backbone.lm_head.weight


class _NextToken:
    """From last-position hidden states to log-probabilities: the backbone's own LM head, or, with `exact_head`
    (the target's float32 LM head under a lower-precision copy), the copy's logits with its top `refine`
    candidates recomputed in float32, which removes the copy's rounding of the logits themselves."""

    def __init__(self, backbone, exact_head: torch.Tensor | None, refine: int):
        self.bb, self.w, self.refine = backbone, exact_head, refine

    def __call__(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(n, H) -> float32 logits (n, V), the top-k ids (n, k) and their log-probabilities (n, k), best first."""
        hn = self.bb.norm(h)
        logits = self.bb.logits(hn).float()  # (n, V)
        if self.w is None:
            vals, ids = logits.topk(k, dim=-1)
        else:
            cand = logits.topk(max(self.refine, k), dim=-1).indices  # (n, m)
            exact = torch.einsum("nh,nmh->nm", hn.float(), self.w[cand])  # (n, m)
            if self.bb.lm_head.bias is not None:
                exact = exact + self.bb.lm_head.bias.float()[cand]
            if self.bb.softcap:
                exact = torch.tanh(exact / self.bb.softcap) * self.bb.softcap
            logits.scatter_(-1, cand, exact)
            vals, order = exact.topk(k, dim=-1)
            ids = cand.gather(-1, order)
        return logits, ids, vals - torch.logsumexp(logits, -1, keepdim=True)


def _requests(backbone, prompts: list[list[int]], max_new_tokens: int | list[int]) -> list[int]:
    """Check generate's requests -> each prompt's max_new_tokens."""
    n_req = len(prompts)
    max_new = [max_new_tokens] * n_req if isinstance(max_new_tokens, int) else list(max_new_tokens)
    check(len(max_new) == n_req and all(m >= 1 for m in max_new), "generate: max_new_tokens must be >= 1 per prompt")
    check(all(len(p) > 0 for p in prompts), "generate: every prompt needs at least one token")
    need = [len(p) + m for p, m in zip(prompts, max_new)]
    check(not need or max(need) <= backbone.max_positions,
          f"generate: prompt + answer of {max(need or [0])} tokens exceed the model's {backbone.max_positions} positions")
    return max_new


def generate(backbone, prompts: list[list[int]], max_new_tokens: int | list[int], stop_ids, *,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, topk: int = 0,
             batch: BatchSettings = BatchSettings(), progress: bool | str = False,
             on_done: Callable[[int, Answer], None] | None = None, exact_head: torch.Tensor | None = None) -> list[Answer]:
    """Continue every prompt (token ids) until a stop token or its max_new_tokens, in ragged, continuously
    refilled batches (see the module docstring). With topk > 0, the full model's top-k log-probabilities at
    each new position are kept. on_done(index, answer) is called as each prompt finishes (for sharded saving).
    exact_head: see synthesis_backbone (the target's LM head, when `backbone` is a lower-precision copy).
    Inside training.distributed.sharding (data-parallel training), each rank continues every W-th prompt and the
    answers are gathered on every rank (on_done runs on the rank that made the answer); a request's sample
    depends on its index only, so the answers are the ones a single process writes.
    -> one Answer per prompt, in order."""
    max_new = _requests(backbone, prompts, max_new_tokens)
    kw = dict(temperature=temperature, top_p=top_p, seed=seed, topk=topk, batch=batch, progress=progress,
              exact_head=exact_head)
    shard = current_shard()
    if shard is None:
        return _generate(backbone, prompts, max_new, stop_ids, on_done=on_done, **kw)
    mine = [i for i in range(len(prompts)) if shard.owns(i)]
    log.info("data-parallel synthesis: rank %d of %d continues %d of %d prompts", shard.rank, shard.world_size,
             len(mine), len(prompts))
    done = (lambda j, answer: on_done(mine[j], answer)) if on_done is not None else None
    answers = _generate(backbone, [prompts[i] for i in mine], [max_new[i] for i in mine], stop_ids, on_done=done,
                        requests=mine, **kw)
    return gather_in_order(shard, len(prompts), dict(zip(mine, answers)))


class _Batch:
    """`_generate`'s batch: slot s < n_active is a live row. A row holds one request's K/V in the ragged cache, its
    last token, its step count and limit, the tokens it wrote and their recorded top-k."""

    def __init__(self, backbone, prompts: list[list[int]], max_new: list[int], requests: list[int], stop_ids,
                 sampler: _Sampler, next_token: _NextToken, k_rec: int, on_done, bar):
        self.bb, self.prompts, self.max_new, self.requests = backbone, prompts, max_new, requests
        self.dev, self.dtype = backbone.device, backbone.dtype
        self.kvh, self.hd, self.n_layers = backbone.kv_shape.kv_heads, backbone.kv_shape.head_dim, backbone.num_layers
        self.stops = torch.tensor(sorted(set(int(s) for s in stop_ids)) or [-1], device=self.dev)
        self.sampler, self.next_token, self.k_rec, self.k_top = sampler, next_token, k_rec, max(1, k_rec)
        self.m_max = max(max_new)
        self.on_done, self.bar = on_done, bar
        self.cache: _RaggedCache | None = None
        self.req: list[int] = []  # slot -> request index
        self.gens: list = []  # slot -> its request's sampling generator
        self.n_active = 0
        self.last = self.steps = self.limit = self.toks = self.rec_ids = self.rec_lp = None
        self.results: list[Answer | None] = [None] * len(prompts)

    def allocate(self, rows: int, length: int) -> None:
        """A cache of `rows` slots x `length` positions (and per-slot state), the live rows carried over."""
        dev, m_max, k_rec, n_active = self.dev, self.m_max, self.k_rec, self.n_active
        new = _RaggedCache(self.n_layers, rows, self.kvh, self.hd, length, self.dtype, dev)
        fresh = dict(
            last=torch.zeros(rows, dtype=torch.long, device=dev), steps=torch.zeros(rows, dtype=torch.long, device=dev),
            limit=torch.zeros(rows, dtype=torch.long, device=dev), toks=torch.zeros(rows, m_max, dtype=torch.long, device=dev),
            rec_ids=torch.zeros(rows, m_max, k_rec, dtype=torch.long, device=dev),
            rec_lp=torch.zeros(rows, m_max, k_rec, dtype=torch.float32, device=dev),
        )
        cache = self.cache
        if cache is not None and n_active:  # carry the live rows over
            span = int(cache.lens[:n_active].max())
            new.k[:, :n_active, :, :span] = cache.k[:, :n_active, :, :span]
            new.v[:, :n_active, :, :span] = cache.v[:, :n_active, :, :span]
            new.lens[:n_active] = cache.lens[:n_active]
            for key, t in fresh.items():
                t[:n_active] = getattr(self, key)[:n_active]
        self.cache = new
        for key, t in fresh.items():
            setattr(self, key, t)

    def record(self, slots: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Choose each slot's next token from its last hidden state (n, H), keep it and its top-k; -> (n,) tokens."""
        logits, top_ids, top_lp = self.next_token(h, self.k_top)
        sampler = self.sampler
        tok = top_ids[:, 0] if sampler.temperature <= 0 else sampler(logits, [self.gens[s] for s in slots.tolist()])
        at = self.steps[slots]
        self.toks[slots, at] = tok
        if self.k_rec:
            self.rec_ids[slots, at] = top_ids
            self.rec_lp[slots, at] = top_lp
        self.steps[slots] += 1
        self.last[slots] = tok
        return tok

    def prefill(self, new: list[int], prefill_tokens: int) -> None:
        """Run the prompts of `new` into slots n_active.. (chunks of right-padded rows through a plain KVCache,
        copied over) and choose their first tokens."""
        bb, dev, prompts, cache = self.bb, self.dev, self.prompts, self.cache
        chunk: list[int] = []
        for i, r in enumerate(new):
            chunk.append(r)
            T = max(len(prompts[j]) for j in chunk)
            if i + 1 < len(new) and (len(chunk) + 1) * max(T, len(prompts[new[i + 1]])) <= prefill_tokens:
                continue
            rows = [prompts[j] for j in chunk]
            nb = len(rows)
            ids = right_pad(rows, 0)  # (nb, T)
            tmp = KVCache(range(self.n_layers), nb, self.kvh, self.hd, T, self.dtype, dev)
            # Right padding needs no mask: with causal attention no real position sees a later pad.
            h = bb.run_layers(bb.embed(ids.to(dev)), 0, self.n_layers, tmp, 0)  # (nb, T, H)
            ends = torch.tensor([len(p) - 1 for p in rows], device=dev)

            s0 = self.n_active
            cache.k[:, s0 : s0 + nb, :, :T] = tmp.k
            cache.v[:, s0 : s0 + nb, :, :T] = tmp.v
            cache.lens[s0 : s0 + nb] = ends + 1
            self.steps[s0 : s0 + nb] = 0
            self.limit[s0 : s0 + nb] = torch.tensor([self.max_new[j] for j in chunk], device=dev)
            for j in chunk:
                self.req.append(j)
                self.gens.append(self.sampler.generator(self.requests[j], dev))
            self.n_active += nb
            self.record(torch.arange(s0, s0 + nb, device=dev), h[torch.arange(nb, device=dev), ends])
            chunk = []

    def step(self) -> None:
        """One decode step of every live row."""
        bb, cache, n = self.bb, self.cache, self.n_active
        cache.step(n)
        pos = cache.lens[:n, None]  # (n, 1) each row's new position = its length
        slots = torch.arange(cache.span, device=self.dev)[None]  # (1, span)
        key_pos = torch.where(slots <= pos, slots, -1)  # (n, span): own slots up to the new one
        h = bb.run_layers(bb.embed(self.last[:n, None]), 0, self.n_layers, cache, positions=pos, key_positions=key_pos)
        cache.lens[:n] += 1
        self.record(torch.arange(n, device=self.dev), h[:, -1])

    def retire(self) -> None:
        """Hand over the rows that just stopped and close the gaps (the last live rows move into them)."""
        n, dev, cache, stops = self.n_active, self.dev, self.cache, self.stops
        last, steps, limit, toks, rec_ids, rec_lp = self.last, self.steps, self.limit, self.toks, self.rec_ids, self.rec_lp
        done = (torch.isin(last[:n], stops) | (steps[:n] >= limit[:n])).tolist()
        if not any(done):
            return
        for s in [s for s in range(n) if done[s]]:
            m = int(steps[s])
            finished = bool(torch.isin(toks[s, m - 1], stops))
            ans = Answer(toks[s, :m].tolist(), rec_ids[s, :m].cpu().clone(), rec_lp[s, :m].cpu().clone(), finished)
            self.results[self.req[s]] = ans
            if self.on_done is not None:
                self.on_done(self.req[s], ans)
            self.bar.update(1)
        keep = [s for s in range(n) if not done[s]]
        n2 = len(keep)
        holes = [s for s in range(n2) if done[s]]
        movers = [s for s in keep if s >= n2]
        if movers:
            span = int(cache.lens[torch.tensor(movers, device=dev)].max())
            src, dst = torch.tensor(movers, device=dev), torch.tensor(holes, device=dev)
            cache.k[:, dst, :, :span] = cache.k[:, src, :, :span]
            cache.v[:, dst, :, :span] = cache.v[:, src, :, :span]
            for t in (cache.lens, last, steps, limit, toks, rec_ids, rec_lp):
                t[dst] = t[src]
            for d, s in zip(holes, movers):
                self.req[d], self.gens[d] = self.req[s], self.gens[s]
        del self.req[n2:], self.gens[n2:]
        self.n_active = n2


@torch.inference_mode()
def _generate(backbone, prompts: list[list[int]], max_new: list[int], stop_ids, *, temperature: float, top_p: float,
              seed: int, topk: int, batch: BatchSettings, progress: bool | str, on_done, exact_head,
              requests: list[int] | None = None) -> list[Answer]:
    """generate's loop over checked requests; requests[i] is prompt i's index in the caller's list (its sampling
    generator's seed; default: i)."""
    n_req = len(prompts)
    if n_req == 0:
        return []
    requests = list(range(n_req)) if requests is None else requests
    need = [len(p) + m for p, m in zip(prompts, max_new)]
    queue = deque(sorted(range(n_req), key=lambda i: (len(prompts[i]), i)))  # shortest first: similar lengths batch together
    k_rec = max(0, int(topk))
    bar = tqdm(total=n_req, desc=progress if isinstance(progress, str) else "generating", unit="prompt",
               disable=not progress)
    b = _Batch(backbone, prompts, max_new, requests, stop_ids, _Sampler(temperature, top_p, seed),
               _NextToken(backbone, exact_head, max(64, 2 * k_rec)), k_rec, on_done, bar)
    while queue or b.n_active:
        if queue:
            # Size the cache for the next prompt (and the live rows); grow it when it no longer fits.
            longest = max([need[queue[0]], *(need[b.req[s]] for s in range(b.n_active))])
            length = _round_up(longest, 128)
            rows = max(1, min(batch.max_batch, batch.token_budget // length))
            if b.cache is None or (need[queue[0]] > b.cache.max_len and b.n_active <= rows):
                b.allocate(rows, max(length, b.cache.max_len if b.cache is not None else 0))
            free = b.cache.batch - b.n_active
            if need[queue[0]] <= b.cache.max_len and free > 0 and (free >= max(1, b.cache.batch // 8) or b.n_active == 0):
                new = []
                while queue and len(new) < free and need[queue[0]] <= b.cache.max_len:
                    new.append(queue.popleft())
                b.prefill(new, batch.prefill_tokens)
                b.retire()  # a first token may already be a stop
                continue
        if not b.n_active:
            continue
        b.step()
        b.retire()
    bar.close()
    return b.results  # type: ignore[return-value]


# ====================================================================================== prompts and answers
def _cut_at_stop(gen: list[int], stop_ids: set[int]) -> tuple[list[int], bool]:
    """New tokens up to and including the first stop token -> (tokens, finished)."""
    for i, t in enumerate(gen):
        if t in stop_ids:
            return gen[: i + 1], True
    return gen, False


def magpie_prefixes(tokenizer, systems: list[str] | None = None) -> tuple[list[list[int]], int | None]:
    """The user-turn prefixes to sample behind: none and one per system message. -> (prefixes, end of turn)."""
    prefixes = [user_turn_prefix(tokenizer, s) for s in [None, *(systems or [])]]
    return [p for p, _ in prefixes], prefixes[0][1]


def sample_prompts(backbone, tokenizer, n: int, max_tokens: int, temperature: float, top_p: float,
                   batch: BatchSettings | int, seed: int, stop_ids: list[int], progress: bool = True,
                   systems: list[str] | None = None, exclude: Callable[[str], bool] | None = None,
                   exact_head: torch.Tensor | None = None) -> list[str]:
    """n distinct non-empty user messages sampled from the target behind its user-turn prefix. With `systems`,
    the requests cycle through no system message and each of these (Magpie's domain steering). `exclude`
    drops a message it returns True for (e.g. one too close to an evaluation prompt)."""
    batch = batch if isinstance(batch, BatchSettings) else BatchSettings(max_batch=batch)
    prefixes, end_of_turn = magpie_prefixes(tokenizer, systems)
    stops = sorted({*stop_ids, *([end_of_turn] if end_of_turn is not None else [])})
    stop_set = set(stops)
    seen: set[str] = set()
    prompts: list[str] = []
    offset = 0
    for _ in range(4):  # duplicates are rare; give up rather than loop forever
        want = n - len(prompts)
        if want <= 0:
            break
        count = want + max(2, want // 8)
        reqs = [prefixes[(offset + i) % len(prefixes)] for i in range(count)]
        outs = generate(backbone, reqs, max_tokens, stops, temperature=max(temperature, 1e-5), top_p=top_p,
                        seed=seed * 7919 + offset, batch=batch, progress="sampling prompts" if progress else False,
                        exact_head=exact_head)
        offset += count
        for out in outs:
            tokens, _ = _cut_at_stop(out.response, stop_set)
            text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
            if text and text not in seen and len(prompts) < n and not (exclude and exclude(text)):
                seen.add(text)
                prompts.append(text)
    return prompts


def answer_prompts(backbone, prompt_ids: list[list[int]], max_tokens: int | list[int], temperature: float,
                   top_p: float, batch: BatchSettings | int, seed: int, stop_ids: list[int], topk: int,
                   progress: bool = True, on_done: Callable[[int, Answer], None] | None = None,
                   exact_head: torch.Tensor | None = None) -> list[Answer]:
    """The target's answers to chat-encoded prompts, with its top-k distribution at every answer position."""
    batch = batch if isinstance(batch, BatchSettings) else BatchSettings(max_batch=batch)
    return generate(backbone, prompt_ids, max_tokens, stop_ids, temperature=temperature, top_p=top_p, seed=seed,
                    topk=topk, batch=batch, progress="answering" if progress else False, on_done=on_done,
                    exact_head=exact_head)


# ====================================================================================== HF generate (reference)
@torch.inference_mode()
def answer_prompts_hf(hf_model, prompt_ids: list[list[int]], max_tokens: int, temperature: float, top_p: float,
                      batch_size: int, seed: int, stop_ids: list[int], pad_id: int, topk: int,
                      cache_implementation: str | None = None) -> list[Answer]:
    """The same answers through HF `generate` in left-padded batches of `batch_size` prompts (sorted by
    length), each running until its longest row stops (model/hf_baselines.py: generate_with_topk): the path
    `generate` replaced, kept as the reference that eval/synth_throughput.py measures against
    (cache_implementation="static" tries HF's static cache)."""
    stops = set(stop_ids)
    answers = []
    for new, top_ids, top_lp in generate_with_topk(hf_model, prompt_ids, max_tokens, temperature, top_p, batch_size, seed,
                                                   stop_ids, pad_id, topk, cache_implementation):
        response, finished = _cut_at_stop(new, stops)
        n = len(response)
        answers.append(Answer(response, top_ids[:n].clone(), top_lp[:n].clone(), finished))
    return answers


# ====================================================================================== scoring given text
def score_sequences(backbone, sequences: list[tuple[list[int], list[int]]], topk: int, batch_size: int = 8,
                    progress: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Top-k of the full model at each response position of given (prompt, response) pairs, by one forward
    pass per batch (for responses the target did not write itself). -> [(ids (n, k), logprobs (n, k))].
    Inside training.distributed.sharding each rank scores every W-th pair and the results are gathered."""
    shard = current_shard()
    if shard is None:
        return _score(backbone, sequences, range(len(sequences)), topk, batch_size, progress)
    mine = [i for i in range(len(sequences)) if shard.owns(i)]
    scored = _score(backbone, sequences, mine, topk, batch_size, progress)
    return gather_in_order(shard, len(sequences), {i: scored[i] for i in mine})


@torch.inference_mode()
def _score(backbone, sequences, indices, topk: int, batch_size: int, progress: bool) -> list:
    """score_sequences over sequences[i] for i in indices (the others stay None)."""
    out: list = [None] * len(sequences)
    order = sorted(indices, key=lambda i: sum(map(len, sequences[i])))
    bar = tqdm(total=len(order), desc="scoring", unit="seq", disable=not progress)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        rows = [sequences[i][0] + sequences[i][1] for i in idx]
        ids = right_pad(rows, 0).to(backbone.device)
        # Right padding needs no mask: with causal attention no real position sees a later pad.
        h = backbone.run_layers(backbone.embed(ids), 0, backbone.num_layers)  # (B, T, H)
        for r, i in enumerate(idx):
            P, n = len(sequences[i][0]), len(sequences[i][1])
            logp = backbone.logits(backbone.norm(h[r, P - 1 : P - 1 + n])).float().log_softmax(-1)  # (n, V)
            top = logp.topk(topk, dim=-1)
            out[i] = (top.indices.cpu(), top.values.cpu())
        bar.update(len(idx))
    bar.close()
    return out

