"""Old vs new on tiny random models: token ids and stats (no timings) of every decode mode, greedy and sampled.

Run it in two checkouts and compare the JSON files (216 configurations; issue 20 showed them identical):
    (cd OLD && python /path/to/eval/equivalence_tiny.py /tmp/old.json); python eval/equivalence_tiny.py /tmp/new.json
    python -c "import json;a,b=(json.load(open(f)) for f in (\"/tmp/old.json\",\"/tmp/new.json\"));print(sum(a[k]!=b[k] for k in a))"
"""
import json, sys, torch
sys.path.insert(0, "tests")
from conftest import make_tiny, randomize_head
from selfspec.decoding.config import DecodeConfig
torch.set_num_threads(1)
out = {}
MODES = {
 "ar": dict(strategy="autoregressive"),
 "chain": dict(draft_len=4), "chain_k1": dict(draft_len=1), "thr": dict(draft_len=5, draft_threshold=0.3),
 "tree_static": dict(tree="static", tree_shape=[2, 2, 1]), "tree_dyn": dict(tree="dynamic", tree_nodes=8),
 "lookup_branch": dict(lookup=True, lookup_min_ngram=1), "lookup_first": dict(lookup=True, lookup_mode="first", lookup_min_ngram=1),
 "lookup_checked": dict(lookup=True, lookup_mode="checked", lookup_min_ngram=1, draft_len=5),
 "dyn_lookup": dict(tree="dynamic", tree_nodes=8, lookup=True, lookup_branches=2, lookup_min_ngram=1),
 "ahead": dict(tokens_per_pass=2, draft_len=5), "ahead_first": dict(tokens_per_pass=2, draft_len=5, lookup=True, lookup_mode="first", lookup_min_ngram=1),
}
SKIP_TIME = {"draft_s", "verify_s", "seconds", "tokens_per_s", "draft_ms_per_token", "ms_per_token"}
for arch in ("llama", "qwen2"):
    for head, prec in (("medusa", "full"), ("lens", "int8"), (None, "full"), ("adapter", "full")):
        m = make_tiny(arch)
        if head:
            m.set_head(head, exit_layer=2, draft_precision=prec, **({"num_heads": 3} if head == "medusa" else {}))
            randomize_head(m.head, seed=2, std=0.2)
        ids = m.encode("The quick brown fox jumps over the lazy dog. The quick brown")
        for name, kw in MODES.items():
            if head is None and not kw.get("lookup") and kw.get("strategy") != "autoregressive":
                continue
            if head is None and kw.get("tree"):
                continue
            if kw.get("tokens_per_pass") and head != "medusa":
                continue
            for temp, seed in ((0.0, 0), (0.9, 1), (0.9, 2)):
                cfg = DecodeConfig(max_new_tokens=30, temperature=temp, seed=seed, top_k=8 if temp else 0, **kw)
                try:
                    r = m.generate(ids, decode=cfg)
                    st = {k: v for k, v in r.stats.items() if k not in SKIP_TIME and "_s" not in k[-2:] and "per_s" not in k}
                    out[f"{arch}/{head}/{prec}/{name}/{temp}/{seed}"] = [r.token_ids, st]
                except Exception as e:
                    out[f"{arch}/{head}/{prec}/{name}/{temp}/{seed}"] = f"ERR {type(e).__name__}: {e}"
json.dump(out, open(sys.argv[1], "w"), indent=0, sort_keys=True, default=str)
print(len(out))
