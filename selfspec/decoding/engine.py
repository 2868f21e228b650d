"""One engine, two strategies: autoregressive (draft_len 0) and self-speculative.

A round of self-speculative decoding with n committed tokens (the last one, x[n-1], not yet run through
the full stack) is four steps over a `DecodeState`:

  draft   for i < k: the drafter's logits for position n+i -> draft token d[i] (drafters.py)
  verify  the rest of the stack over positions n-1 .. n-1+k in ONE forward, scoring all k+1 rows
  accept  greedy: longest prefix with d == argmax p, then the target's token;
          sampling: min(1, p/q) test, residual or bonus sample (sampling.py)
  commit  a accepted drafts + 1 target token; every cache's valid length drops to n_new - 1

Caches are written by position (cache.py), so the commit step is the rollback. Where the drafts come from,
and how much of the draft's work verification can reuse, is the drafter's business (drafters.py); the
autoregressive baseline is the same loop with k = 0 (NoDrafter).

With decode.tree=static|dynamic or decode.lookup=true (lookup_mode=branch) a round verifies a draft tree instead (tree.py), in the
same four steps over the same state (draft_tree, verify_tree, accept_tree, commit_tree): the root is x[n-1] at
slot n-1; the drafter runs each depth's frontier in one call (tree mask among the new rows), context lookup adds
branches (lookup.py); the full stack runs over every node in one pass (node at row r, slot n-1+r, rotary position
n-1+depth); acceptance takes the longest matching path (greedy) or recursive rejection sampling over siblings; the
commit moves the accepted path's K/V (and the drafter's per-slot state) to where a chain decode writes them.

With decode.tokens_per_pass=m > 1, `draft` makes m drafts per pass through layers < E: the head's extra heads
(Medusa's t+2, t+3, ...) propose the tokens after the first from the same layer-E state, and the next pass runs
layers < E over those m drafts at once; verification is unchanged, and under sampling each draft's q is the
distribution of the head that proposed it.

With decode.lookup_mode=first (and a head) the rounds stay chains: `draft` takes context lookup's continuation
when the history has a match (no model pass; under sampling a one-hot q, so acceptance is min(1, p(d))) and the
head's drafts otherwise; the drafter runs layers < E over lookup's tokens in `verify_input`, as over a last draft.

The engine returns token ids and `DecodeStats`; it does no I/O. A greedy chain round reads the device back once
(`commit`: the accepted count, the target's token and the drafts, in one small tensor; drafts stay on the device and the
accept rule runs there; EOS, stop strings and lookup work on the host copy of the new tokens), and on CUDA the
draft / verify split comes from events that `finish` reads with one wait (`_Timer`); dynamic K (draft_threshold) reads
each draft's confidence, which its stop rule needs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from selfspec.decoding.config import STRATEGIES, DecodeConfig
from selfspec.decoding.drafters import Drafter, NoDrafter, make_drafter
from selfspec.decoding.lookup import NgramIndex
from selfspec.decoding.sampling import greedy_accept, process_logits, sample, speculative_accept
from selfspec.decoding.stats import DecodeStats
from selfspec.decoding.tree import (
    Tree,
    add_branches,
    chain_tree,
    dynamic_tree,
    greedy_accept_tree,
    sample_accept_tree,
    static_tree,
)
from selfspec.errors import SelfSpecError, check
from selfspec.model.cache import KVCache

__all__ = ["STRATEGIES", "DecodeConfig", "DecodeResult", "DecodeState", "DecodeStats", "Decoder", "Draft", "TreeDraft"]

StopFn = Callable[[list[int]], "int | None"]
Observer = Callable[[list[int], torch.Tensor], None]


class _Timer:
    """The draft / verify split of one generation. CPU: the wall clock at each phase end. CUDA: an event recorded at
    each phase end, so the loop never waits for the device; `settle` (at the end of the generation, after its one
    final synchronization) adds the times between the events to the stats."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.start = self.t = time.perf_counter()
        self.marks: list[tuple[str, object, object]] = []  # CUDA: (stats field, start event, end event)
        self.last = self._event() if self.cuda else None

    @staticmethod
    def _event():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def lap(self, stats: DecodeStats, key: str) -> None:
        """The phase that ends now goes to stats.<key> (draft_s, verify_s)."""
        if self.cuda:
            end = self._event()
            self.marks.append((key, self.last, end))
            self.last = end
            return
        now = time.perf_counter()
        setattr(stats, key, getattr(stats, key) + now - self.t)
        self.t = now

    def settle(self, stats: DecodeStats) -> None:
        """CUDA: wait for the last event once and add every phase's time to the stats."""
        if self.marks:
            self.marks[-1][2].synchronize()
            for key, a, b in self.marks:
                setattr(stats, key, getattr(stats, key) + a.elapsed_time(b) / 1000)
            self.marks = []


@dataclass
class DecodeState:
    """Everything one generation holds between rounds."""

    cfg: DecodeConfig
    tokens: torch.Tensor  # (max_len,) ids: [0, n) committed, [n, n+k) this round's drafts
    prompt_len: int
    n: int  # committed tokens; the last one has not been through the full stack yet
    cache: KVCache  # the target's, all L layers, written by position
    drafter: Drafter
    draft_len: int  # K (0: autoregressive)
    eos: torch.Tensor  # (E,) ids that end the generation
    generator: torch.Generator | None  # sampling only
    stats: DecodeStats
    verified: int = 0  # positions [0, verified) hold the full stack's K/V in every layer of `cache`
    done: bool = False
    timer: _Timer | None = None
    lookup: NgramIndex | None = None  # decode.lookup: the committed tokens' n-gram index
    tree_rounds: bool = False  # rounds verify trees (decode_tree): decode.tree, lookup branches, lookup without a head
    eos_ids: frozenset = frozenset()  # `eos` on the host: a round's EOS check needs no device round trip
    out: list[int] = field(default_factory=list)  # the new tokens [prompt_len, n) on the host

    @property
    def new_tokens(self) -> int:
        return self.n - self.prompt_len


@dataclass
class Draft:
    """One round's proposal: tokens d[0..k) for positions n .. n+k-1 (greedy head drafts: 0-d tensors on the
    device, never read back one by one; sampled and lookup drafts: ints), and (sampling) the (V,) draft
    distributions they were drawn from. A draft tree would add each node's parent."""

    tokens: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)
    lookup: bool = False  # the tokens came from context lookup (decode.lookup_mode=first), not the head
    lookup_prefix: int = 0  # decode.lookup_mode=checked: the first this many tokens are lookup's, kept by the head


@dataclass
class TreeDraft:
    """One tree round's proposal: the tree (node 0 = x[n-1] at slot `root`; None = nothing proposed) and, once
    verified, each node's verify row (`rows`, node i at slot root + rows[i]) and the rows' order (`order`, None =
    tree order)."""

    tree: Tree | None
    root: int
    order: torch.Tensor | None = None
    rows: torch.Tensor | None = None


@dataclass
class DecodeResult:
    token_ids: list[int]  # new tokens (a final EOS included, as HF does)
    stats: DecodeStats


def _pick(logits: torch.Tensor, cfg: DecodeConfig, generator) -> tuple[int | torch.Tensor, torch.Tensor | None, float]:
    """(V',) draft logits -> (draft index, its distribution q (sampling only), the draft's confidence).

    Greedy: the index is a (1,) tensor on the device and, without decode.draft_threshold, nothing is read back (the
    round's one host sync is in `commit`); dynamic K reads the confidence back, the one thing its stop rule needs."""
    if cfg.greedy:
        idx = logits.argmax().view(1)
        conf = float(logits.float().softmax(-1).index_select(0, idx)) if cfg.draft_threshold else 1.0
        return idx, None, conf
    q = process_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p)
    return int(sample(q, generator)), q, float(q.max())


def _token(drafter: Drafter, idx: int | torch.Tensor) -> int | torch.Tensor:
    """A draft index -> its token id: an int, or for a (1,) device index a 0-d device tensor (index_select, never a
    0-d tensor index, which torch reads back to the host)."""
    if not isinstance(idx, torch.Tensor):
        return drafter.token_id(idx)
    vocab = drafter.vocab_ids
    return (vocab.index_select(0, idx) if vocab is not None else idx)[0]


class Decoder:
    """Decodes one sequence (batch 1) with a Backbone and an optional exit head.

    `drafter_factory(backbone, head, max_len) -> Drafter` makes each generation's drafter (default: the head's
    own way of drafting, drafters.make_drafter); another one plugs another way of drafting into the same loop."""

    def __init__(self, backbone, head=None, drafter_factory: Callable[..., Drafter] = make_drafter):
        self.bb = backbone
        self.head = head
        self.drafter_factory = drafter_factory

    # ---------------------------------------------------------------- the loop
    @torch.inference_mode()
    def decode(self, prompt_ids, cfg: DecodeConfig, eos_ids: Sequence[int] = (), stop_fn: StopFn | None = None,
               observer: Observer | None = None) -> DecodeResult:
        """prompt_ids: 1-D ids. stop_fn(new_ids) -> number of tokens to keep if a stop string completed, else None.
        observer(token_ids, logits): called after each verify with the ids through the last draft and the
        target's (k+1, V) logits at the last k+1 positions (for tests and analysis; no I/O here). With
        decode.tree / decode.lookup the rounds are tree rounds (decode_tree)."""
        state = self.start(prompt_ids, cfg, eos_ids)
        if state.tree_rounds:
            return self.decode_tree(state, stop_fn, observer)
        while not state.done:
            draft = self.draft(state)
            logits = self.verify(state, draft)
            if observer is not None:
                observer(state.tokens[: state.n + len(draft.tokens)].tolist(), logits)
            accepted, nxt = self.accept(state, draft, logits)
            self.commit(state, draft, accepted, nxt, stop_fn)
        return self.finish(state)

    def decode_tree(self, state: DecodeState, stop_fn: StopFn | None = None, observer: Observer | None = None) -> DecodeResult:
        """decode's loop over tree rounds (decode.tree / decode.lookup), from `start`'s state; observer(ids through
        x[n-1], the target's (N, V) logits after each tree node, in tree order)."""
        while not state.done:
            draft = self.draft_tree(state)
            if draft.tree is None:  # nothing proposed (no room, no lookup match): the chain's step with k = 0
                chain = Draft()
                logits = self.verify(state, chain)
                if observer is not None:
                    observer(state.tokens[: state.n].tolist(), logits)
                self.commit(state, chain, *self.accept(state, chain, logits), stop_fn)  # extends the lookup index
                continue
            logits = self.verify_tree(state, draft)
            if observer is not None:
                observer(state.tokens[: state.n].tolist(), logits)
            path, nxt = self.accept_tree(state, draft, logits)
            self.commit_tree(state, draft, path, nxt, stop_fn)
        return self.finish(state)

    def generate(self, prompt_ids, cfg: DecodeConfig, eos_ids: Sequence[int] = (), stop_fn: StopFn | None = None,
                 observer: Observer | None = None) -> tuple[list[int], dict]:
        """`decode` with the stats as a dict: (new token ids, stats dict)."""
        result = self.decode(prompt_ids, cfg, eos_ids, stop_fn, observer)
        return result.token_ids, result.stats.to_dict()

    # ---------------------------------------------------------------- steps
    def start(self, prompt_ids, cfg: DecodeConfig, eos_ids: Sequence[int] = ()) -> DecodeState:
        """Check the request and allocate one generation's buffers; the clock starts here."""
        bb, spec = self.bb, cfg.strategy == "selfspec"
        trees = spec and cfg.uses_tree
        check(not (spec and cfg.tree == "auto"),
              "decode.tree=auto: not resolved; calibration chooses the tree (python -m selfspec.eval decode.tree=auto, or "
              "selfspec.evaluation.calibration.calibrate_tree), then decode with its choice (decode.tree=chain|static|dynamic)")
        if spec and self.head is None and self.drafter_factory is make_drafter:
            check(cfg.lookup, "decode.strategy=selfspec needs a head (head=lens|medusa|adapter|lora|layer|DIR) "
                              "or decode.lookup=true (context-lookup drafts alone)")
            check(cfg.tree == "chain", f"decode.tree={cfg.tree}: drafts a tree with an exit head; without one use decode.tree=chain")
        dev = bb.device
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=dev).reshape(-1)
        P = prompt.numel()
        check(P >= 1, "prompt: must not be empty")
        lo, hi = int(prompt.min()), int(prompt.max())
        check(lo >= 0 and hi < bb.vocab_size, f"prompt: token id {lo if lo < 0 else hi} is outside the vocabulary [0, {bb.vocab_size})")
        if P + cfg.max_new_tokens > bb.max_positions:
            raise SelfSpecError(
                f"decode.max_new_tokens={cfg.max_new_tokens}: prompt ({P} tokens) + max_new_tokens exceeds the model's context ({bb.max_positions})"
            )
        K = cfg.draft_len if spec else 0
        cfg.check_fits(bb.max_positions)  # every size of the round against this model, before anything is allocated
        max_len = P + cfg.max_new_tokens + (cfg.tree_slots() if trees or spec and cfg.lookup else K) + 1
        generator = None
        if not cfg.greedy:
            generator = torch.Generator(device=dev)
            if cfg.seed is not None:
                generator.manual_seed(cfg.seed)
            else:  # a fresh seed for this generator only: the caller's global generator is left alone
                generator.seed()
        ks = bb.kv_shape
        cache = KVCache(range(bb.num_layers), 1, ks.kv_heads, ks.head_dim, max_len, bb.dtype, dev)
        tokens = torch.zeros(max_len, dtype=torch.long, device=dev)
        tokens[:P] = prompt
        drafter = self.drafter_factory(bb, self.head, max_len) if spec else NoDrafter(bb)
        if spec and cfg.lookup and isinstance(drafter, NoDrafter):
            trees = True  # lookup without a head: the lookup chain of the tree steps, in either lookup_mode
        if spec and not isinstance(drafter, NoDrafter):
            check(cfg.tokens_per_pass <= drafter.max_ahead,
                  f"decode.tokens_per_pass={cfg.tokens_per_pass}: this head proposes at most {drafter.max_ahead} "
                  f"token{'s' if drafter.max_ahead > 1 else ''} per pass (a medusa head with head.num_heads >= "
                  f"{cfg.tokens_per_pass} proposes that many)")
        if trees:
            K = cfg.tree_depth(head=not isinstance(drafter, NoDrafter))
        deepest = cfg.tree_depth(head=True) if spec and cfg.lookup_first and not trees else K  # lookup's or the head's
        stats = DecodeStats(strategy=cfg.strategy, exit_layer=drafter.exit_layer, draft_len=deepest, prompt_tokens=P,
                            drafted_per_position=[0] * deepest, accepted_per_position=[0] * deepest,
                            draft_precision=drafter.draft_precision, draft_bytes=drafter.draft_bytes)
        eos_set = frozenset(int(e) for e in eos_ids)
        eos = torch.tensor(sorted(eos_set), dtype=torch.long, device=dev)
        state = DecodeState(cfg, tokens, P, P, cache, drafter, K, eos, generator, stats, tree_rounds=trees, eos_ids=eos_set)
        if trees or spec and cfg.lookup:  # lookup_mode=first with a head: chain rounds with the lookup counts
            stats.tree, stats.lookup = cfg.tree, cfg.lookup
            if cfg.lookup:
                state.lookup = NgramIndex(prompt.tolist(), cfg.lookup_min_ngram, cfg.lookup_max_ngram)
        state.timer = _Timer(dev)
        return state

    def draft(self, state: DecodeState) -> Draft:
        """Up to K drafts for positions n, n+1, ... (fewer near max_new_tokens, or under draft_threshold); with
        decode.lookup_mode=first, context lookup's proposal instead whenever it has one."""
        cfg, n, drafter = state.cfg, state.n, state.drafter
        draft, start = Draft(), 0
        if state.lookup is not None and cfg.lookup_mode == "checked":
            start = self._checked_lookup(state, draft)
        elif state.lookup is not None:
            draft = self._lookup_draft(state)
            if draft.tokens:
                return draft
        k, m = min(state.draft_len, cfg.max_new_tokens - state.new_tokens - 1), cfg.tokens_per_pass
        rows = None
        for i in range(start, k):
            if m == 1:
                logits = drafter.draft_logits(state, n + i)  # (V',)
                state.stats.draft_steps += 1
            else:  # one pass through layers < E proposes the next m drafts (the head's extra heads)
                if i % m == 0:
                    rows = drafter.draft_ahead_logits(state, n + i, min(m, k - i))  # (m', V')
                    state.stats.draft_steps += 1
                logits = rows[i % m]
            idx, q, conf = _pick(logits, cfg, state.generator)
            if cfg.draft_threshold and conf < cfg.draft_threshold:
                break
            tok = _token(drafter, idx)
            if q is not None:
                draft.q.append(drafter.full_distribution(q))
            state.tokens[n + i] = tok
            draft.tokens.append(tok)
        if state.draft_len:
            state.timer.lap(state.stats, "draft_s")
        return draft

    def _checked_lookup(self, state: DecodeState, draft: Draft) -> int:
        """decode.lookup_mode=checked: context lookup's chain (at most K tokens) through the head in ONE pass; its
        tokens are kept up to the first one the head's argmax disagrees with, where the head's own draft (argmax, or
        sampled from its q) takes over; the round's loop drafts on from there. -> drafts made. Sampling: a kept
        lookup token is a deterministic proposal (one-hot q), the head's token carries the head's q."""
        cfg, n, drafter = state.cfg, state.n, state.drafter
        room = min(cfg.lookup_len, state.draft_len, cfg.max_new_tokens - state.new_tokens - 1)
        tokens = next(iter(state.lookup.propose_many(room, 1)), []) if room > 0 else []
        if not tokens:
            return 0
        state.tokens[n : n + len(tokens)] = torch.tensor(tokens, dtype=torch.long, device=state.tokens.device)
        rows = drafter.draft_rows_logits(state, n, len(tokens))  # (L, V'): the head after each lookup prefix
        state.stats.draft_steps += 1
        agree = [drafter.token_id(i) for i in rows.argmax(-1).tolist()]  # the round's one read-back
        for j, tok in enumerate(tokens):
            if agree[j] == tok:  # kept: a deterministic proposal
                draft.tokens.append(tok)
                draft.lookup_prefix += 1
                if not cfg.greedy:
                    draft.q.append(torch.zeros(self.bb.vocab_size, dtype=torch.float32, device=rows.device).index_fill_(0, torch.tensor([tok], device=rows.device), 1.0))
                continue
            drafter.rollback(n + j)  # positions from n + j on held lookup's tokens: stale for the draft
            idx, q, conf = _pick(rows[j], cfg, state.generator)
            tok = _token(drafter, idx)
            if q is not None:
                draft.q.append(drafter.full_distribution(q))
            state.tokens[n + j] = tok
            draft.tokens.append(tok)
            return j + 1
        return len(tokens)

    def _lookup_draft(self, state: DecodeState) -> Draft:
        """Context lookup's chain for positions n, n+1, ... ([] without a match); sampling: each draft's q is
        one-hot (the proposal is deterministic), so acceptance is min(1, p(d)) and the residual p without d."""
        cfg, n = state.cfg, state.n
        room = min(cfg.lookup_len, cfg.max_new_tokens - state.new_tokens - 1)
        # the lookup chain's own proposal (draft_tree): a match whose continuation runs into the end of the history
        # (a repetition) gives way to an earlier one that has all `room` tokens
        tokens = next(iter(state.lookup.propose_many(room, 1)), []) if room > 0 else []
        draft = Draft(tokens=tokens, lookup=True)
        if tokens:
            ids = torch.tensor(tokens, dtype=torch.long, device=state.tokens.device)
            state.tokens[n : n + len(tokens)] = ids
            if not cfg.greedy:
                one_hot = torch.zeros(len(tokens), self.bb.vocab_size, dtype=torch.float32, device=ids.device)
                draft.q = list(one_hot.scatter_(1, ids[:, None], 1.0))
            state.timer.lap(state.stats, "draft_s")
        return draft

    def verify(self, state: DecodeState, draft: Draft) -> torch.Tensor:
        """The full stack over positions n-1 .. n-1+k in one pass -> the target's (k+1, V) logits there."""
        bb, k = self.bb, len(draft.tokens)
        end = state.n + k
        h, start = state.drafter.verify_input(state, end)
        h = bb.run_layers(h, start, bb.num_layers, state.cache, pos0=state.verified)
        state.verified = end
        return bb.logits(bb.norm(h[0, -(k + 1) :]))  # (k+1, V)

    def accept(self, state: DecodeState, draft: Draft, logits: torch.Tensor) -> tuple[int | torch.Tensor, torch.Tensor]:
        """-> (accepted drafts a, the target's next token); greedy: both on the device (read back in `commit`)."""
        cfg, k = state.cfg, len(draft.tokens)
        d = state.tokens[state.n : state.n + k]
        if cfg.greedy:
            return greedy_accept(d, logits)
        p = process_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p)
        return speculative_accept(d, torch.stack(draft.q) if k else p[:0], p, state.generator)

    def commit(self, state: DecodeState, draft: Draft, accepted: int | torch.Tensor, nxt: torch.Tensor,
               stop_fn: StopFn | None = None) -> None:
        """Keep a accepted drafts and the target's token; roll back the rest; stop at EOS / length / stop string.
        The round's one device -> host transfer: (a, the target's token, the drafts) in one small tensor."""
        n, k, dev = state.n, len(draft.tokens), state.tokens.device
        row = torch.cat([torch.as_tensor(accepted, device=dev).reshape(1), torch.as_tensor(nxt, device=dev).reshape(1),
                         state.tokens[n : n + k]]).tolist()
        a, nxt_id, drafts = row[0], row[1], row[2:]
        state.stats.record_round(k, a)
        if draft.lookup or draft.lookup_prefix:
            kept = k if draft.lookup else draft.lookup_prefix
            state.stats.drafted_lookup += kept
            state.stats.accepted_lookup += min(a, kept)
        state.tokens[n + a] = nxt_id
        self._advance(state, a, drafts[:a] + [nxt_id], stop_fn)
        self._extend_lookup(state, n)

    def _advance(self, state: DecodeState, accepted: int, committed: list[int], stop_fn: StopFn | None) -> None:
        """Tokens [n, n+a] hold the accepted drafts and the target's token (`committed`, on the host): roll back every
        position past the new last token, stop at EOS / length / stop string."""
        n, P = state.n, state.prompt_len
        new_n = n + accepted + 1
        # positions >= new_n - 1 are stale or pending (the new last token has not been through the full stack)
        keep = new_n - 1
        state.verified = min(state.verified, keep)
        state.drafter.rollback(keep)
        hit = next((i for i, t in enumerate(committed) if t in state.eos_ids), None)
        if hit is not None:
            new_n = n + hit + 1  # keep the EOS, drop anything after it
            committed = committed[: hit + 1]
            state.done = True
        state.n = new_n
        state.out.extend(committed)
        if state.new_tokens >= state.cfg.max_new_tokens:
            state.done = True
        if stop_fn is not None:
            cut = stop_fn(list(state.out))
            if cut is not None:
                state.n = P + cut
                del state.out[cut:]
                state.done = True
        state.timer.lap(state.stats, "verify_s")

    # ---------------------------------------------------------------- tree steps (decode.tree / decode.lookup)
    def draft_tree(self, state: DecodeState) -> TreeDraft:
        """The round's tree: the head's (static / dynamic, or a chain of draft_len), plus context-lookup branches;
        no deeper than max_new_tokens leaves room for."""
        cfg, root = state.cfg, state.n - 1
        room = cfg.max_new_tokens - state.new_tokens - 1
        tree = None
        if room > 0 and not isinstance(state.drafter, NoDrafter):
            tree = self._head_tree(state, root, room)
        if state.lookup is not None and room > 0:
            branches = state.lookup.propose_many(min(cfg.lookup_len, room), cfg.lookup_branches)
            if branches:
                tree = add_branches(tree or chain_tree(int(state.tokens[root]), []), branches)
        state.timer.lap(state.stats, "draft_s")
        return TreeDraft(tree, root)

    def _head_tree(self, state: DecodeState, root: int, room: int) -> Tree:
        cfg, drafter, stats = state.cfg, state.drafter, state.stats
        root_logits = drafter.draft_logits(state, root + 1)  # (V',) after the root
        stats.draft_steps += 1

        def draft_fn(frontier):
            stats.draft_steps += 1
            return drafter.draft_tree_logits(state, root, frontier)

        common = dict(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, vocab_ids=drafter.vocab_ids,
                      vocab_size=self.bb.vocab_size)
        token = int(state.tokens[root])
        if cfg.tree == "dynamic":
            return dynamic_tree(token, root_logits, draft_fn, depth=min(cfg.draft_len, room), topk=cfg.tree_topk,
                                nodes=cfg.tree_nodes + 1, **common)
        shape = cfg.tree_shape if cfg.tree == "static" else [1] * cfg.draft_len
        return static_tree(token, root_logits, shape[:room], draft_fn, generator=state.generator, **common)

    def verify_tree(self, state: DecodeState, draft: TreeDraft) -> torch.Tensor:
        """The full stack over every node in one pass (tree mask, rotary position = root + depth) -> the target's
        (N, V) logits after each node, in tree order."""
        if draft.tree is None:
            draft.tree = chain_tree(int(state.tokens[draft.root]), [])
        bb, tree, root, drafter = self.bb, draft.tree, draft.root, state.drafter
        if state.verified < root:  # the prompt (first round): through the full stack as a chain first
            h, start = drafter.verify_input(state, root)
            bb.run_layers(h, start, bb.num_layers, state.cache, pos0=state.verified)
            state.verified = root
        order = draft.order = drafter.tree_order(tree)
        mask, depth = (tree.mask, tree.depth) if order is None else (tree.mask[order][:, order], tree.depth[order])
        h, start = drafter.tree_verify_input(state, tree, root, order, mask)
        h = bb.run_layers(h, start, bb.num_layers, state.cache, pos0=root, positions=root + depth, tree_mask=mask)
        logits = bb.logits(bb.norm(h[0]))  # (N, V): row r is node order[r]'s
        if order is None:
            draft.rows = torch.arange(len(tree))
            return logits
        draft.rows = torch.empty_like(order)
        draft.rows[order] = torch.arange(len(tree))
        return logits[draft.rows.to(logits.device)]

    def accept_tree(self, state: DecodeState, draft: TreeDraft, logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """-> (the accepted path as node indices from the root, the target's next token)."""
        cfg = state.cfg
        if cfg.greedy:
            return greedy_accept_tree(draft.tree, logits)
        p = process_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p)
        return sample_accept_tree(draft.tree, p, state.generator)

    def commit_tree(self, state: DecodeState, draft: TreeDraft, path: list[int], nxt: torch.Tensor,
                    stop_fn: StopFn | None = None) -> None:
        """The accepted path's K/V (and the drafter's) to positions root, root+1, ...; then as a chain's commit."""
        tree, root, n, a = draft.tree, draft.root, state.n, len(path) - 1
        state.cache.compact([root + r for r in draft.rows[path].tolist()], root)
        state.drafter.commit_tree(state, tree, path, root, draft.rows)
        state.verified = root + a + 1
        if a:
            state.tokens[n : n + a] = tree.tokens[path[1:]].to(state.tokens.device)
        state.stats.record_tree_round(int(tree.depth[-1]), len(tree) - 1, tree.source.count("lookup"), a,
                                      sum(tree.source[i] == "lookup" for i in path))
        state.tokens[n + a] = nxt
        self._advance(state, a, state.tokens[n : n + a + 1].tolist(), stop_fn)
        self._extend_lookup(state, n)

    @staticmethod
    def _extend_lookup(state: DecodeState, n: int) -> None:
        """The round's committed tokens [n, state.n) into the context-lookup index."""
        if state.lookup is not None and not state.done:
            state.lookup.extend(state.out[n - state.prompt_len :])

    def finish(self, state: DecodeState) -> DecodeResult:
        new = list(state.out)
        state.timer.settle(state.stats)  # CUDA: the generation's one wait for the device's clock
        state.stats.new_tokens = len(new)
        state.stats.seconds = time.perf_counter() - state.timer.start
        return DecodeResult(new, state.stats)
