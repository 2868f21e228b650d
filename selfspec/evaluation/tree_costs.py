"""Verify cost vs rows: what a draft tree's verify pass costs on this hardware, in autoregressive steps.

A tree of T nodes is verified in one full-stack pass over T rows with a tree attention mask (see
selfspec/decoding/tree.py). How that cost grows with T decides how big a tree pays: on a GPU it is nearly flat,
on a CPU the weights are read once but the arithmetic grows with T. For each T in `rows`, at a context of
`context` tokens, each the median over `repeats` of its time divided by an autoregressive step timed right
before it (costs.median_ratio):
  tree        layers [0, L) over T tree rows (a tree mask, rotary position = depth) + norm + LM head + argmax,
              as the backbone runs it by default: the C decoder layer up to cpu_kernels.TREE_MAX_ROWS rows
  tree_torch  the same with the CPU kernels off (torch's matmuls and SDPA): where the C layer stops paying
  chain       the same rows as a causal chunk (the C layer only up to cpu_kernels.MAX_ROWS rows)
`tree_c_layer` / `chain_c_layer` say whether the C decoder layer ran. Costs do not depend on the weights or the
cache's contents, so a random-init model of the real shapes measures the same thing.

    python eval/verify_rows.py --model smollm2_135m --context 200 --repeats 20
"""

from __future__ import annotations

import contextlib

import torch

from selfspec.decoding.tree import ancestor_mask
from selfspec.errors import check
from selfspec.evaluation.costs import median_ratio, median_seconds
from selfspec.utils.markdown import RIGHT, table
from selfspec.model import cpu_kernels
from selfspec.model.cache import KVCache

ROWS = (1, 2, 4, 8, 16, 32, 64)


def tree_parents(n: int, branching: int = 4) -> list[int]:
    """A full tree of n nodes in depth order, each node with up to `branching` children (parents[0] = -1)."""
    return [-1] + [(i - 1) // branching for i in range(1, n)]


@contextlib.contextmanager
def _kernels(bb, on: bool):
    saved = bb.cpu_kernels
    bb.cpu_kernels = saved and on
    try:
        yield
    finally:
        bb.cpu_kernels = saved


def _c_layer_runs(bb, rows: int, tree: bool) -> bool:
    limit = cpu_kernels.TREE_MAX_ROWS if tree else cpu_kernels.MAX_ROWS
    return bool(
        bb.cpu_kernels and bb.lean is not None and bb.device.type == "cpu" and bb.dtype == torch.float32
        and rows <= limit and any(layer.c_weights is not None and layer.usable() for layer in bb.lean)
    )


def verify_rows_costs(backbone, rows=ROWS, context: int = 200, repeats: int = 20, warmup: int = 3,
                      branching: int = 4, seed: int = 0) -> dict:
    """Verify cost vs rows (module docstring) -> {"ar_step_s", "context", "rows": {T: {tree, tree_torch, chain,
    tree_c_layer, chain_c_layer}}, ...}, plain JSON-able values."""
    bb = backbone
    rows = [int(t) for t in rows]
    check(bool(rows) and all(t >= 1 for t in rows), f"verify_rows.rows={rows}: integers >= 1")
    check(context >= 1 and context + max(rows) <= bb.max_positions,
          f"verify_rows.context={context}: must be >= 1 with context + {max(rows)} rows within the model's {bb.max_positions} positions")
    ks, dev, L = bb.kv_shape, bb.device, bb.num_layers
    cache = KVCache(range(L), 1, ks.kv_heads, ks.head_dim, context + max(rows) + 1, bb.dtype, dev)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, min(bb.vocab_size, 256), (max(rows),), generator=g).to(dev)  # any ids cost the same

    def ar_step():
        h = bb.run_layers(bb.embed(tokens[None, :1]), 0, L, cache, pos0=context)
        return int(bb.logits(bb.norm(h[0, -1:])).argmax())

    def verify_step(T: int, tree: bool, kernels: bool = True):
        mask = ancestor_mask(torch.tensor(tree_parents(T, branching))).to(dev) if tree else None

        def step():
            with _kernels(bb, kernels):
                h = bb.run_layers(bb.embed(tokens[None, :T]), 0, L, cache, pos0=context, tree_mask=mask)
                return bb.logits(bb.norm(h[0])).argmax(-1).tolist()

        return step

    out = {"context": context, "repeats": repeats, "branching": branching, "num_layers": L,
           "device": str(dev), "dtype": str(bb.dtype).removeprefix("torch."),
           "tree_max_rows": cpu_kernels.TREE_MAX_ROWS, "chain_max_rows": cpu_kernels.MAX_ROWS, "rows": {}}
    with torch.inference_mode():
        out["ar_step_s"] = median_seconds(ar_step, dev, repeats, warmup)
        for T in rows:
            out["rows"][T] = {
                "tree": median_ratio(verify_step(T, True), ar_step, dev, repeats, warmup),
                "tree_torch": median_ratio(verify_step(T, True, kernels=False), ar_step, dev, repeats, warmup),
                "chain": median_ratio(verify_step(T, False), ar_step, dev, repeats, warmup),
                "tree_c_layer": _c_layer_runs(bb, T, tree=True),
                "chain_c_layer": _c_layer_runs(bb, T, tree=False),
            }
    return out


def verify_rows_markdown(costs: dict, title: str = "Verify cost vs rows") -> str:
    def fmt(r, c_layer=None):
        return f"{r:.2f}" + ("" if c_layer is None else (" (C)" if c_layer else " (torch)"))

    body = [[T, fmt(v["tree"], v["tree_c_layer"]), fmt(v["tree_torch"]), fmt(v["chain"], v["chain_c_layer"])]
            for T, v in costs["rows"].items()]
    lines = [
        f"# {title}", "",
        f"One full-stack pass over T rows + LM head, in autoregressive steps ({costs['ar_step_s'] * 1e3:.2f} ms) at a "
        f"{costs['context']}-token context, {costs['num_layers']} layers, {costs['device']} / {costs['dtype']}, median of "
        f"{costs['repeats']} paired timings. Tree: up to {costs['branching']} children per node; (C) = the C decoder layer "
        f"ran (tree rows <= {costs['tree_max_rows']}, chain rows <= {costs['chain_max_rows']}).", "",
        *table(["rows", "tree", "tree, torch", "chain"], body, [RIGHT] * 4),
    ]
    return "\n".join(lines) + "\n"
