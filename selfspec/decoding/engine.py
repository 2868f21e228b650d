"""One engine, two strategies: autoregressive (draft_len 0) and self-speculative.

A round of self-speculative decoding with n committed tokens (the last one, x[n-1], not yet run through
the full stack):

  draft   for i < k: run layers [0, E) on the new token(s), exit head -> draft token d[i+1]
  verify  run the rest of the stack over positions n-1 .. n-1+k in ONE forward, score all k+1 rows
  accept  greedy: longest prefix with d == argmax p, then the target's token;
          sampling: min(1, p/q) test, residual or bonus sample (sampling.py)
  commit  a accepted drafts + 1 target token; every cache's valid length drops to n_new - 1

Caches are written by position (cache.py), so the commit step is the rollback. With heads that leave
layers < E untouched (lens, medusa, adapter) the draft's early-layer K/V and layer-E hidden states *are* the
verifier's: verification runs layers < E over just the last draft token and layers >= E over the k+1
positions (LayerSkip's reuse). The LoRA head changes layers < E, so it drafts through its own cache and
verification runs the full base stack. The autoregressive baseline is the same loop with k = 0.

The engine returns token ids and stats; it does no I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from selfspec.decoding.sampling import greedy_accept, process_logits, sample, speculative_accept
from selfspec.errors import SelfSpecError, check
from selfspec.model.cache import KVCache

STRATEGIES = ("autoregressive", "self_speculative")


@dataclass
class DecodeConfig:
    strategy: str = "self_speculative"
    draft_len: int = 4
    draft_threshold: float | None = None  # dynamic K: stop drafting when the draft's top-1 prob < this
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int | None = 0
    stop: list[str] = field(default_factory=list)  # stop strings

    def __post_init__(self):
        check(self.strategy in STRATEGIES, f"decode.strategy={self.strategy!r}: allowed {', '.join(STRATEGIES)}")
        check(isinstance(self.draft_len, int) and self.draft_len >= 1, f"decode.draft_len={self.draft_len}: must be an integer >= 1")
        check(
            self.draft_threshold is None or 0.0 <= self.draft_threshold < 1.0,
            f"decode.draft_threshold={self.draft_threshold}: must be in [0, 1) or null",
        )
        check(self.temperature >= 0, f"decode.temperature={self.temperature}: must be >= 0 (0 = greedy)")
        check(isinstance(self.top_k, int) and self.top_k >= 0, f"decode.top_k={self.top_k}: must be an integer >= 0 (0 = off)")
        check(0.0 < self.top_p <= 1.0, f"decode.top_p={self.top_p}: must be in (0, 1]")
        check(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, f"decode.max_new_tokens={self.max_new_tokens}: must be an integer >= 1")
        self.stop = [s for s in self.stop if s]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class _Timer:
    """Wall-clock phases; on CUDA, synchronizes at phase ends so the split is honest."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.t = time.perf_counter()

    def lap(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt


class Decoder:
    """Decodes one sequence (batch 1) with a Backbone and an optional exit head."""

    def __init__(self, backbone, head=None):
        self.bb = backbone
        self.head = head

    @torch.inference_mode()
    def generate(self, prompt_ids, cfg: DecodeConfig, eos_ids=(), stop_fn=None, observer=None) -> tuple[list[int], dict]:
        """prompt_ids: 1-D ids. stop_fn(new_ids) -> number of tokens to keep if a stop string completed, else None.
        observer(token_ids, logits): called after each verify with the ids through the last draft and the
        target's (k+1, V) logits at the last k+1 positions (for tests and analysis; no I/O here).
        Returns (new token ids, including a final EOS as HF does; stats)."""
        bb, head = self.bb, self.head
        spec = cfg.strategy == "self_speculative"
        if spec and head is None:
            raise SelfSpecError("decode.strategy=self_speculative needs a head (head=lens|medusa|adapter|lora|DIR)")
        dev = bb.device
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=dev).reshape(-1)
        P = prompt.numel()
        check(P >= 1, "prompt: must not be empty")
        if P + cfg.max_new_tokens > bb.max_positions:
            raise SelfSpecError(
                f"decode.max_new_tokens={cfg.max_new_tokens}: prompt ({P} tokens) + max_new_tokens exceeds the model's context ({bb.max_positions})"
            )
        K = cfg.draft_len if spec else 0
        L = bb.num_layers
        E = head.exit_layer if spec else L
        reuse = spec and head.reuses_early_layers
        max_len = P + cfg.max_new_tokens + K + 1
        eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=dev)
        gen = None
        if not cfg.greedy:
            gen = torch.Generator(device=dev)
            gen.manual_seed(cfg.seed if cfg.seed is not None else torch.seed())

        ks = bb.kv_shape
        main = KVCache(range(L), 1, ks.kv_heads, ks.head_dim, max_len, bb.dtype, dev)
        tokens = torch.zeros(max_len, dtype=torch.long, device=dev)
        tokens[:P] = prompt
        # Valid lengths: how many leading positions each cache holds correctly.
        v_early = v_late = 0  # main cache, layers < E and layers >= E (equal unless reuse)
        v_draft = 0  # the LoRA head's draft cache (layers < E, adapted weights)
        v_head = 0  # the adapter head's own cache
        hbuf = torch.zeros(1, max_len, bb.hidden_size, dtype=bb.dtype, device=dev) if reuse else None
        dcache = KVCache(range(E), 1, ks.kv_heads, ks.head_dim, max_len, bb.dtype, dev) if spec and not reuse else None
        hstate = head.new_state(bb, max_len) if spec else None
        vocab_ids = head.vocab_ids.to(dev) if spec and head.has_draft_vocab else None

        drafted_pos = [0] * K
        accepted_pos = [0] * K
        steps = drafted = accepted = draft_steps = 0
        t_draft = t_verify = 0.0
        n = P
        done = False
        timer = _Timer(dev)
        start = timer.t

        def draft_step(e: int) -> torch.Tensor:
            """Feed every token up to position e-1 that the draft path has not seen; -> (V',) logits for e."""
            nonlocal v_early, v_draft, v_head
            if reuse:
                s = v_early
                h = bb.run_layers(bb.embed(tokens[None, s:e]), 0, E, main, pos0=s)
                hbuf[:, s:e] = h
                v_early = e
                if hstate is not None:  # the adapter attends over all positions: feed what it has not seen
                    hs = v_head
                    v_head = e
                    return head(hbuf[:, hs:e], bb, hstate, pos0=hs, last_only=True)[0, -1]
            else:
                s = v_draft
                with head.drafting():
                    h = bb.run_layers(bb.embed(tokens[None, s:e]), 0, E, dcache, pos0=s)
                v_draft = e
            return head(h[:, -1:], bb)[0, -1]

        while not done:
            remaining = cfg.max_new_tokens - (n - P)
            k_max = min(K, remaining - 1)

            # ---------------- draft
            drafts: list[int] = []
            qrows: list[torch.Tensor] = []
            for i in range(k_max):
                logits_q = draft_step(n + i)
                draft_steps += 1
                if cfg.greedy:
                    idx = int(logits_q.argmax())
                    conf = float(logits_q.float().softmax(-1)[idx]) if cfg.draft_threshold else 1.0
                else:
                    q = process_logits(logits_q, cfg.temperature, cfg.top_k, cfg.top_p)
                    idx = int(sample(q, gen))
                    conf = float(q.max())
                if cfg.draft_threshold and conf < cfg.draft_threshold:
                    break
                tok = int(vocab_ids[idx]) if vocab_ids is not None else idx
                if not cfg.greedy:
                    if vocab_ids is not None:  # q lives on the draft vocabulary: zero elsewhere
                        q = torch.zeros(bb.vocab_size, dtype=q.dtype, device=dev).index_copy_(0, vocab_ids, q)
                    qrows.append(q)
                tokens[n + i] = tok
                drafts.append(tok)
            k = len(drafts)
            if spec:
                t_draft += timer.lap()

            # ---------------- verify: the full stack over positions n-1 .. n-1+k
            end = n + k
            if reuse:
                if v_early < end:  # the last draft token has not been through layers < E yet
                    hbuf[:, v_early:end] = bb.run_layers(bb.embed(tokens[None, v_early:end]), 0, E, main, pos0=v_early)
                    v_early = end
                h = bb.run_layers(hbuf[:, v_late:end], E, L, main, pos0=v_late)
            else:
                h = bb.run_layers(bb.embed(tokens[None, v_late:end]), 0, L, main, pos0=v_late)
                v_early = end
            v_late = end
            logits_p = bb.logits(bb.norm(h[0, -(k + 1):]))  # (k+1, V)
            if observer is not None:
                observer(tokens[:end].tolist(), logits_p)

            # ---------------- accept
            d = tokens[n:end]
            if cfg.greedy:
                a, nxt = greedy_accept(d, logits_p)
            else:
                p = process_logits(logits_p, cfg.temperature, cfg.top_k, cfg.top_p)
                a, nxt = speculative_accept(d, torch.stack(qrows) if k else p[:0], p, gen)
            tokens[n + a] = nxt
            new_n = n + a + 1
            steps += 1
            drafted += k
            accepted += a
            for i in range(k):
                drafted_pos[i] += 1
                accepted_pos[i] += int(i < a)

            # ---------------- commit (= rollback: positions >= new_n - 1 are stale or pending)
            keep = new_n - 1
            v_early, v_late, v_draft, v_head = (min(v, keep) for v in (v_early, v_late, v_draft, v_head))
            new_tokens = tokens[n:new_n]
            if eos.numel():
                hits = torch.isin(new_tokens, eos).nonzero()
                if hits.numel():
                    new_n = n + int(hits[0, 0]) + 1  # keep the EOS, drop anything after it
                    done = True
            n = new_n
            if n - P >= cfg.max_new_tokens:
                done = True
            if stop_fn is not None:
                cut = stop_fn(tokens[P:n].tolist())
                if cut is not None:
                    n = P + cut
                    done = True
            t_verify += timer.lap()

        total = time.perf_counter() - start
        new = tokens[P:n].tolist()
        stats = {
            "strategy": cfg.strategy,
            "exit_layer": E if spec else None,
            "draft_len": K,
            "new_tokens": len(new),
            "verify_steps": steps,
            "tau": len(new) / steps if steps else 0.0,
            "drafted": drafted,
            "draft_steps": draft_steps,  # exit-head passes, including drafts declined under draft_threshold
            "accepted": accepted,
            "accept_rate": accepted / drafted if drafted else None,
            "drafted_per_position": drafted_pos,
            "accepted_per_position": accepted_pos,
            "accept_rate_per_position": [a / d if d else None for a, d in zip(accepted_pos, drafted_pos)],
            "draft_s": t_draft,
            "verify_s": t_verify,
            "seconds": total,
            "tokens_per_s": len(new) / total if total > 0 else 0.0,
            "prompt_tokens": P,
        }
        return new, stats
