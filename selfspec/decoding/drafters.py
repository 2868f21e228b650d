"""Drafters: how an exit head proposes tokens inside the engine, one object per generation.

The engine (engine.py) asks a drafter three things and never looks at the head behind it:

  draft_logits(state, pos)    (V',) draft logits for the token at position `pos`, given tokens [0, pos) in
                              state.tokens (every position the drafter has not seen yet is fed first)
  draft_ahead_logits(state, pos, m)   (m, V') for positions pos .. pos+m-1 from the same pass (decode.tokens_per_pass:
                              a head's extra heads, at most `max_ahead`)
  verify_input(state, end)    (h, start_layer): what the verify pass runs layers [start_layer, L) on, for
                              positions state.verified .. end-1
  rollback(keep)              positions >= keep are stale (rejected drafts, or not yet final)

plus `exit_layer` and `vocab_ids` (draft index -> token id; None = the full vocabulary).

Today's heads draft in two ways:
  EarlyExitDrafter   heads that leave layers < E untouched (lens, medusa, adapter): drafting runs layers [0, E)
                     straight into the target's cache and keeps their layer-E states, which verification
                     reuses (LayerSkip): layers < E then run only over the last draft token.
  OwnCacheDrafter    heads that change layers < E (LoRA): drafting runs them in the head's `drafting()`
                     context into a cache of its own; verification runs the full base stack.
Either carries the head's per-generation state (`head.new_state`, e.g. the adapter's KV cache), fed with every
layer-E state the head has not seen. NoDrafter is the autoregressive baseline (k = 0).

A head gets its drafter from `make_drafter`; a new way of drafting (a second model) is a new Drafter subclass
with the same three methods.

Draft trees (decode.tree / decode.lookup; proposers/trees.py builds them, verify.py verifies them) ask four more:

  draft_tree_logits(state, root, frontier)   (F, V') draft logits after a tree depth's frontier nodes (tree.Frontier),
                                             their rows written at draft slots root + frontier.slot .. with its mask
  tree_order(tree)                           the verify pass's row order (row r holds node order[r]; None = tree order)
  tree_verify_input(state, tree, root, order, mask)   (h, start_layer) for the verify rows, written at root, root+1, ..
  commit_tree(state, tree, path, root, rows)  the accepted path (node indices) becomes positions root, root+1, ..:
                                             move what the drafter keeps by slot there (the engine moves the target's
                                             cache; rows[i] is node i's verify row)

EarlyExitDrafter keeps layers < E of the drafted nodes (verification reorders their K/V and layer-E states into the
verify rows and runs layers < E only for nodes the draft never ran); OwnCacheDrafter and NoDrafter verify every node
from its embedding. A head with per-generation state attends over it with the tree's mask and rotary positions
(TreeRows), and its state is compacted along the accepted path like the caches.
"""

from __future__ import annotations

import torch

from selfspec.errors import SelfSpecError
from selfspec.model.cache import KVCache, compact_rows
from selfspec.model.cpu_kernels import MAX_ROWS


class Drafter:
    """The base: no drafts of its own; verification runs the whole stack from the token embeddings."""

    exit_layer: int | None = None
    vocab_ids: torch.Tensor | None = None  # (V',) token id of each draft index; None = all V tokens
    max_ahead = 1  # tokens one draft pass can propose (decode.tokens_per_pass)
    draft_precision = "full"  # the draft pass's weights (head.draft_precision)

    @property
    def draft_bytes(self) -> int:
        """Bytes of the low-precision weight copies the draft pass reads (0: it reads the model's own)."""
        return 0

    def __init__(self, backbone, head=None, max_len: int = 0):
        self.bb = backbone
        self.head = head

    def draft_logits(self, state, pos: int) -> torch.Tensor:
        return self.draft_ahead_logits(state, pos, 1)[0]

    def draft_chain(self, state, pos: int, count: int, q_out: torch.Tensor | None = None) -> bool:
        """Drafts for positions pos .. pos+count-1 (tokens [0, pos) in state.tokens) written to state.tokens by one
        kernel call -> True; False: this drafter drafts pass by pass (draft_logits). Greedy; with q_out (count, V'),
        sampled under state.cfg's temperature and top-p, each draft's distribution written to its row."""
        return False

    def draft_chain_dynamic(self, state, pos: int, count: int, threshold: float, cont: float,
                            q_out: torch.Tensor | None = None) -> tuple[int, int] | None:
        """Drafts for positions pos .. pos+count-1 in one kernel call, stopped as HeadChain stops them
        (decode.draft_threshold, decode.draft_continue; 0 = off) and written to state.tokens -> (drafts made, draft
        passes); None: this drafter drafts pass by pass. Greedy; with q_out as in draft_chain, sampled."""
        return None

    def draft_ahead_logits(self, state, pos: int, ahead: int) -> torch.Tensor:  # pragma: no cover - NoDrafter never drafts
        raise NotImplementedError

    def verify_input(self, state, end: int) -> tuple[torch.Tensor, int]:
        """(1, T, H) input of layer `start` for positions state.verified .. end-1, and start."""
        return self.bb.embed(state.tokens[None, state.verified : end]), 0

    def rollback(self, keep: int) -> None:
        pass

    def verify_stack(self, h: torch.Tensor, start: int, cache, **kw) -> tuple[torch.Tensor, torch.Tensor]:
        """The verify pass: layers [start, L) over h (run_layers' arguments) -> (the output before the final norm,
        what `observe_verified` gets: the output, or for a head that reads several depths (head.context_depths)
        their states side by side)."""
        depths = self.head.context_depths if self.head is not None else ()
        if len(depths) <= 1:
            h = self.bb.run_layers(h, start, self.bb.num_layers, cache, **kw)
            return h, h
        h, states = self.bb.run_capturing(h, start, self.bb.num_layers, depths[:-1], cache, **kw)
        return h, torch.cat([*states, h], dim=-1)

    def observe_verified(self, state, h: torch.Tensor, pos0: int) -> None:
        """h (1, T, k*H): from `verify_stack`, the full stack's output (before the final norm) at positions (tree:
        slots) pos0 .. pos0+T-1 (or the states at the head's context depths side by side), just computed by
        verification; positions a later `rollback` drops are stale. Heads that read the verified context keep it;
        the others ignore it."""

    def assume_seen(self, pos: int) -> None:
        """For timing single steps (evaluation/costs.py): treat positions [0, pos) as already fed, whatever their
        cache slots hold, so the next draft or verify does exactly one step's work."""

    # ---- draft trees (the module doc)
    def draft_tree_logits(self, state, root: int, frontier) -> torch.Tensor:
        raise SelfSpecError(f"decode.tree: {type(self).__name__} does not draft trees; use decode.tree=chain")

    def tree_order(self, tree) -> torch.Tensor | None:
        return None

    def tree_verify_input(self, state, tree, root: int, order, mask) -> tuple[torch.Tensor, int]:
        tokens = tree.tokens if order is None else tree.tokens[order]
        return self.bb.embed(tokens.to(self.bb.device)[None]), 0

    def commit_tree(self, state, tree, path: list[int], root: int, rows) -> None:
        pass

    # ---- the draft vocabulary
    def token_id(self, index: int) -> int:
        return int(self.vocab_ids[index]) if self.vocab_ids is not None else index

    @property
    def draft_vocab_size(self) -> int:
        """V': the size of a draft's distribution (the draft vocabulary, else the model's)."""
        return self.bb.vocab_size if self.vocab_ids is None else self.vocab_ids.numel()

    def full_distribution(self, q: torch.Tensor) -> torch.Tensor:
        """(V',) draft probabilities -> (V,), zero outside the draft vocabulary."""
        if self.vocab_ids is None:
            return q
        return torch.zeros(self.bb.vocab_size, dtype=q.dtype, device=q.device).index_copy_(0, self.vocab_ids, q)


class NoDrafter(Drafter):
    """The autoregressive baseline: the same loop with k = 0."""


class _HeadDrafter(Drafter):
    """What both head drafters share: the exit layer, the draft vocabulary, the head's per-generation state, and
    the draft pass's precision (head.draft_precision: `quant` is the backbone's low-precision copies or None, and
    `dbb` the backbone as the head sees it while drafting: its LM head in that precision)."""

    def __init__(self, backbone, head, max_len: int):
        super().__init__(backbone, head, max_len)
        self.exit_layer = head.exit_layer
        self.vocab_ids = head.vocab_ids.to(backbone.device) if head.has_draft_vocab else None
        self.head_state = head.new_state(backbone, max_len)
        self.head_seen = 0  # positions [0, head_seen) the head's state holds
        self.max_ahead = head.max_ahead
        self.reads_context = head.reads_context  # the head keeps the verified positions' full-depth states
        self.draft_precision = head.draft_precision
        self.quant = head.draft_copies(backbone)
        self.dbb = backbone if self.quant is None else PrecisionView(backbone, self.quant)
        if self.quant is not None:  # every copy the draft reads, now (not inside the first timed round)
            self.quant.prepare(backbone, self.exit_layer, head.lm_weight(backbone), own_layers=not head.reuses_early_layers)

    @property
    def draft_bytes(self) -> int:
        return 0 if self.quant is None else self.quant.nbytes

    def _new_hidden(self, state, pos: int) -> torch.Tensor:
        """(1, pos - head_seen, H): layer-E states of the positions the head has not seen, through layers < E."""
        raise NotImplementedError

    def draft_ahead_logits(self, state, pos: int, ahead: int) -> torch.Tensor:
        if self.reads_context:
            self._verify_prompt(state)
        hidden = self._new_hidden(state, pos)
        s, self.head_seen = self.head_seen, pos
        return self.head.ahead_logits(hidden, self.dbb, self.head_state, pos0=s, ahead=ahead)

    def draft_rows_logits(self, state, pos: int, count: int) -> torch.Tensor:
        """(count, V') draft logits for positions pos .. pos+count-1 from ONE pass over rows pos-1 .. pos+count-2
        (tokens [0, pos+count-1) are in state.tokens): a proposed chain (context lookup's) checked by the draft at the
        price of about one draft step (decode.lookup_mode=checked)."""
        end = pos + count - 1
        if self.reads_context:
            self._verify_prompt(state)
        hidden = self._new_hidden(state, end)
        s, self.head_seen = self.head_seen, end
        if self.head_state is None:  # a stateless head needs only the rows it scores
            return self.head(hidden[:, -count:], self.dbb)[0]
        return self.head(hidden, self.dbb, self.head_state, pos0=s)[0, -count:]

    def rollback(self, keep: int) -> None:
        self.head_seen = min(self.head_seen, keep)
        if self.reads_context:
            self.head.rollback(self.head_state, keep)

    def observe_verified(self, state, h: torch.Tensor, pos0: int) -> None:
        """A head that reads the verified context keeps the full-depth states; the rows it fed predicted features in
        their place are fed again (now with verified ones) before its next draft."""
        if self.reads_context:
            self.head.observe(self.head_state, h, pos0)
            self.head_seen = min(self.head_seen, self.head.refeed_from(self.head_state))

    def _verify_prompt(self, state) -> None:
        """Before a round's first draft: committed positions below n-1 that the full stack has not run (the prompt)
        go through it now, so that the head reads their verified states (the verify pass then starts at n-1)."""
        v, end = state.verified, state.n - 1
        if v < end:
            h, start = self.verify_input(state, end)
            _, seen = self.verify_stack(h, start, state.cache, pos0=v)
            state.verified = end
            self.observe_verified(state, seen, v)

    def assume_seen(self, pos: int) -> None:
        self.head_seen = pos
        if self.reads_context:  # and the features of [0, pos) verified: the next draft is one row's
            self.head.assume_verified(self.head_state, pos)

    def _tree_head_logits(self, hidden: torch.Tensor, pos0: int, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """hidden (1, F, H): layer-E states of tree rows at slots pos0.. -> (F, V') logits after each row."""
        bb = self.dbb if self.head_state is None else TreeRows(self.dbb, positions, mask)
        return self.head(hidden, bb, self.head_state, pos0=pos0)[0]

    def _commit_context(self, path: list[int], root: int, rows) -> None:
        """A head that reads the context: the accepted path's full-depth states (observed by verify row) to
        positions root, root+1, ... (ContextHead.commit_path)."""
        if self.reads_context:
            self.head.commit_path(self.head_state, [root + r for r in rows[path].tolist()], root)
            self.head_seen = min(self.head_seen, self.head.refeed_from(self.head_state))

    def _compact_drafted(self, tree, path: list[int], root: int, caches) -> None:
        """The head (and `caches`) saw the drafted nodes at draft slots root + tree.slot: keep the accepted path's
        drafted prefix (a drafted node's parent is drafted) at root, root+1, ..."""
        if self.head_seen <= root:  # nothing drafted this round
            return
        slots = tree.slot[path].tolist()
        j = next((i for i, s in enumerate(slots) if s < 0), len(slots))
        src = [root + s for s in slots[:j]]
        for cache in caches:
            cache.compact(src, root)
        if self.head_state is None or isinstance(self.head_state, KVCache):
            if self.head_state is not None:
                self.head_state.compact(src, root)
            self.head_seen = root + j
        else:  # a state we cannot move: the head sees the path again from the root on
            self.head_seen = root + 1


class PrecisionView:
    """The backbone as a head sees it during a low-precision draft: logits() scores with the LM head (or the draft
    vocabulary's rows) in the draft's precision; everything else is the backbone's."""

    def __init__(self, backbone, quant):
        self.bb = backbone
        self.quant = quant

    def __getattr__(self, name):
        return getattr(self.bb, name)

    def logits(self, h_normed: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return self.bb.logits(h_normed, weight, quant=self.quant)


class TreeRows:
    """The backbone as a head sees it while it runs a draft tree's rows: attention_mask() and apply_rotary() give the
    rows' tree mask and rotary positions (a head's own cache, written by slot like the target's, takes the same
    mask); everything else is the backbone's."""

    def __init__(self, backbone, positions: torch.Tensor, tree_mask: torch.Tensor):
        self.bb = backbone
        self.positions = positions.to(backbone.device)
        self.tree_mask = tree_mask

    def __getattr__(self, name):
        return getattr(self.bb, name)

    def attention_mask(self, pos0: int, q_len: int, kv_len: int, window: int | None, device) -> torch.Tensor:
        assert q_len == self.positions.shape[0], "TreeRows: the head ran other rows than the tree's"
        return self.bb.tree_attention_mask(self.positions.to(device), self.tree_mask, kv_len, window)

    def apply_rotary(self, q, k, positions, dtype=None):
        return self.bb.apply_rotary(q, k, self.positions[None].to(q.device), dtype)


class EarlyExitDrafter(_HeadDrafter):
    """Drafts through layers [0, E) of the target's own cache; verification reuses them (see the module doc)."""

    def __init__(self, backbone, head, max_len: int):
        super().__init__(backbone, head, max_len)
        self.hidden = torch.zeros(1, max_len, backbone.hidden_size, dtype=backbone.dtype, device=backbone.device)
        self.early = 0  # positions [0, early) hold correct layer < E K/V in the target's cache and layer-E states here

    def _run_early(self, state, end: int) -> None:
        s = self.early
        self.hidden[:, s:end] = self.bb.run_layers(self.bb.embed(state.tokens[None, s:end]), 0, self.exit_layer, state.cache, pos0=s)
        self.early = end

    def _new_hidden(self, state, pos: int) -> torch.Tensor:
        self._run_early(state, pos)
        return self.hidden[:, self.head_seen : pos]

    def draft_chain(self, state, pos: int, count: int, q_out: torch.Tensor | None = None) -> bool:
        """A logit lens's chain (Backbone.draft_chain) from the row at pos-1 on, once the rows before it have run:
        the same K/V, layer-E states and drafts as `count` passes of draft_logits, without Python between them."""
        if not self.head.plain_readout or self.head_state is not None:
            return False
        s = pos - 1
        if self.early < s:
            self._run_early(state, s)
        sampled = self._sampling(state, count, q_out)
        done = self.bb.draft_chain(state.cache, self.exit_layer, state.tokens, s, count, self.quant,
                                   self.head.lm_weight(self.bb), self.vocab_ids, self.hidden[0, s : s + count], sampled)
        if done:
            self.early = self.head_seen = s + count
        return done

    def draft_chain_dynamic(self, state, pos: int, count: int, threshold: float, cont: float,
                            q_out: torch.Tensor | None = None) -> tuple[int, int] | None:
        """A context head's chain (Backbone.context_chain): layers < E, the head and the readout of every draft,
        the last draft's layers < E too (verification reads them), in one C call per round."""
        if not self.reads_context:
            return None
        self._verify_prompt(state)
        p0 = pos - 1
        if not self._chain_starts_at(state, p0):
            return None
        parts = self.head.chain_parts(self.head_state)
        if parts is None or parts.real_upto < p0 or not self.head_seen <= p0:
            return None
        self._feed_backlog(state, p0)
        made = self.bb.context_chain(state.cache, self.exit_layer, state.tokens, self.hidden[0], parts, self.early,
                                     self.head_seen, p0, count, threshold, cont, self.quant,
                                     self.head.lm_weight(self.bb), self.vocab_ids, self._sampling(state, count, q_out))
        if made is None:
            return None
        drafts, steps = made
        self.head.chain_ran(self.head_state, self.head_seen, p0)
        self.head_seen, self.early = p0 + steps, p0 + 1 + drafts
        return made

    def _feed_backlog(self, state, p0: int) -> None:
        """Before a chain in one C call: rows below p0 that layers < E or the head have not seen, when there are more
        than a decode step's (the prompt, before the first round), go through them here as pass by pass does (torch's
        blocked GEMM and attention), leaving the C call the last row. Its work buffer holds an attention score for
        each row and key: for all 6,000 rows of a prompt 1.4 GB (SmolLM2-135M), and its attention was slower too."""
        if p0 - self.early >= MAX_ROWS:
            self._run_early(state, p0)
        s = self.head_seen
        if p0 - s >= MAX_ROWS:
            self.head.transform(self.hidden[:, s:p0], self.dbb, self.head_state, pos0=s)
            self.head_seen = p0

    @staticmethod
    def _sampling(state, count: int, q_out: torch.Tensor | None) -> tuple | None:
        """What a chain kernel samples with: (temperature, top_p, one uniform per draft from the generation's
        generator, q_out); None: greedy."""
        if q_out is None:
            return None
        return state.cfg.temperature, state.cfg.top_p, torch.rand(count, generator=state.generator), q_out

    def _chain_starts_at(self, state, p0: int) -> bool:
        """Whether a chain in one call may run layers < E from self.early on (full precision: any rows up to p0)."""
        return self.early <= p0 + 1

    def verify_input(self, state, end: int) -> tuple[torch.Tensor, int]:
        if self.early < end:  # the last draft token has not been through layers < E yet
            self._run_early(state, end)
        return self.hidden[:, state.verified : end], self.exit_layer

    def rollback(self, keep: int) -> None:
        super().rollback(keep)
        self.early = min(self.early, keep)

    def assume_seen(self, pos: int) -> None:
        super().assume_seen(pos)
        self.early = pos

    # ---- draft trees
    def draft_tree_logits(self, state, root: int, frontier) -> torch.Tensor:
        s, bb = root + frontier.slot, self.bb
        h = bb.run_layers(bb.embed(frontier.tokens.to(bb.device)[None]), 0, self.exit_layer, state.cache, pos0=s,
                          tree_mask=frontier.tree_mask)
        self.hidden[:, s : s + h.shape[1]] = h
        return self._tree_head_logits(h, s, root + frontier.depth, frontier.tree_mask)

    def tree_order(self, tree) -> torch.Tensor | None:
        """The drafted nodes first (their layers < E are in the cache), in tree order; then the others."""
        drafted = tree.slot >= 0
        m = int(drafted.sum())
        if bool(drafted[:m].all()):
            return None
        return torch.cat([drafted.nonzero()[:, 0], (~drafted).nonzero()[:, 0]])

    def tree_verify_input(self, state, tree, root: int, order, mask) -> tuple[torch.Tensor, int]:
        if self.early <= root:  # nothing drafted this round: the root has not been through layers < E
            self._run_early(state, root + 1)
        bb, n = self.bb, len(tree)
        order = torch.arange(n) if order is None else order
        slots = tree.slot[order]
        m = int((slots >= 0).sum())
        # the drafted nodes' layer < E K/V and layer-E states: from their draft slots to their verify rows
        state.cache.compact(root + slots[:m], root)
        compact_rows(self.hidden, root + slots[:m], root)
        if m < n:  # nodes the draft never ran (leaves, lookup branches): layers < E here
            rest = order[m:]
            self.hidden[:, root + m : root + n] = bb.run_layers(
                bb.embed(tree.tokens[rest].to(bb.device)[None]), 0, self.exit_layer, state.cache, pos0=root + m,
                positions=root + tree.depth[rest], tree_mask=mask[m:])
        return self.hidden[:, root : root + n], self.exit_layer

    def commit_tree(self, state, tree, path: list[int], root: int, rows) -> None:
        self._compact_drafted(tree, path, root, ())
        self._commit_context(path, root, rows)
        compact_rows(self.hidden, [root + r for r in rows[path].tolist()], root)
        self.early = root + len(path)


class OwnCacheDrafter(_HeadDrafter):
    """Drafts through layers [0, E) as the head changes them (its `drafting()` context), in a cache of its own."""

    def __init__(self, backbone, head, max_len: int):
        super().__init__(backbone, head, max_len)
        ks = backbone.kv_shape
        # its valid length is head_seen: the draft stack and the head see the same positions
        self.cache = KVCache(range(self.exit_layer), 1, ks.kv_heads, ks.head_dim, max_len, backbone.dtype, backbone.device)

    def _new_hidden(self, state, pos: int) -> torch.Tensor:
        s = self.head_seen
        with self.head.drafting():
            return self.bb.run_layers(self.bb.embed(state.tokens[None, s:pos]), 0, self.exit_layer, self.cache, pos0=s,
                                      quant=self.quant)

    def draft_tree_logits(self, state, root: int, frontier) -> torch.Tensor:
        s, bb = root + frontier.slot, self.bb
        with self.head.drafting():
            h = bb.run_layers(bb.embed(frontier.tokens.to(bb.device)[None]), 0, self.exit_layer, self.cache, pos0=s,
                              tree_mask=frontier.tree_mask, quant=self.quant)
        return self._tree_head_logits(h, s, root + frontier.depth, frontier.tree_mask)

    def commit_tree(self, state, tree, path: list[int], root: int, rows) -> None:
        self._compact_drafted(tree, path, root, (self.cache,))
        self._commit_context(path, root, rows)


class LowPrecisionDrafter(EarlyExitDrafter):
    """Drafts through layers [0, E) in the draft's low precision (head.draft_precision=int8|int4|int4_mlp), in the target's
    own cache; nothing of the draft is reused.

    What is shared and what is not:
      - The draft attends over the target's full-precision K/V of every verified position (no second cache).
      - Its own K/V (in-flight drafts, and the round's first position) go to the cache slots at and after
        state.verified: scratch rows, since verification writes every layer there.
      - Verification recomputes layers [0, E) in full precision for all its positions (verify_input), keeping the
        layer-E states it computes for the head; a draft never re-runs a position below state.verified.
    With E = L (a lens at the last layer) the draft is the quantized whole model with its own final norm and LM head.
    """

    def __init__(self, backbone, head, max_len: int):
        super().__init__(backbone, head, max_len)
        self.full = 0  # positions [.., full) of committed tokens that a draft ran through layers < E in full precision

    def _run_early(self, state, end: int) -> None:
        bb = self.bb
        s = max(self.early, state.verified)  # [0, verified) holds the target's K/V: never overwrite it
        c = min(end - 1, state.n - 1)  # committed tokens before the last row (the prompt): what verification computes
        if s < c:
            self.hidden[:, s:c] = bb.run_layers(bb.embed(state.tokens[None, s:c]), 0, self.exit_layer, state.cache, pos0=s)
            self.full, s = c, c
        if s < end:
            self.hidden[:, s:end] = bb.run_layers(bb.embed(state.tokens[None, s:end]), 0, self.exit_layer, state.cache,
                                                  pos0=s, quant=self.quant)
        self.early = max(self.early, end)

    def _chain_starts_at(self, state, p0: int) -> bool:
        """Low precision: only the round's new row (committed rows below it are verification's, in full)."""
        return self.early == p0 and self.early >= state.verified

    def verify_input(self, state, end: int) -> tuple[torch.Tensor, int]:
        bb, v = self.bb, state.verified
        s = min(max(v, self.full), end)  # from the first position no full-precision pass has run
        if s < end:
            self.hidden[:, s:end] = bb.run_layers(bb.embed(state.tokens[None, s:end]), 0, self.exit_layer, state.cache, pos0=s)
        self.early = self.full = end
        return self.hidden[:, v:end], self.exit_layer

    def rollback(self, keep: int) -> None:
        super().rollback(keep)
        self.full = min(self.full, keep)

    def draft_tree_logits(self, state, root: int, frontier) -> torch.Tensor:
        s, bb = root + frontier.slot, self.bb
        h = bb.run_layers(bb.embed(frontier.tokens.to(bb.device)[None]), 0, self.exit_layer, state.cache, pos0=s,
                          tree_mask=frontier.tree_mask, quant=self.quant)
        return self._tree_head_logits(h, s, root + frontier.depth, frontier.tree_mask)

    def tree_order(self, tree) -> torch.Tensor | None:
        return None  # every node is recomputed: tree order as it is

    def tree_verify_input(self, state, tree, root: int, order, mask) -> tuple[torch.Tensor, int]:
        bb, n = self.bb, len(tree)
        self.hidden[:, root : root + n] = bb.run_layers(bb.embed(tree.tokens.to(bb.device)[None]), 0, self.exit_layer,
                                                        state.cache, pos0=root, positions=root + tree.depth, tree_mask=mask)
        self.early = self.full = root + n
        return self.hidden[:, root : root + n], self.exit_layer


def make_drafter(backbone, head, max_len: int) -> Drafter:
    """The drafter for `head` (None: the autoregressive NoDrafter), with buffers for `max_len` positions."""
    if head is None:
        return NoDrafter(backbone)
    if not head.reuses_early_layers:
        return OwnCacheDrafter(backbone, head, max_len)
    cls = EarlyExitDrafter if head.draft_precision == "full" else LowPrecisionDrafter
    return cls(backbone, head, max_len)
