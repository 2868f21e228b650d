"""A/B this checkout against an older commit in ONE process: are the greedy tokens identical, and did any decode
method get slower? (How issue 20's refactor was shown to change nothing.)

    python eval/ab_commit.py OLD_COMMIT --prompts SPEC_BENCH/question.jsonl --per-task 10 --new-tokens 64

The old commit's `selfspec/` (and conf/) is extracted with `git archive` into a temporary directory and imported as
`selfspec_old`, so both engines run side by side on the same prompts, alternating which goes first prompt by prompt.
Prints, per method, whether every prompt's tokens match and the ratio of the new code's decode seconds to the old
code's (1.00 = unchanged; the machine's noise is the spread between repeats). Writes nothing except with --out.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METHODS = {  # name -> (head spec, from_pretrained options, decode keys)
    "autoregressive": (None, {}, dict(strategy="autoregressive")),
    "shipped": ("default", {}, {}),
    "int8_self_draft": ("lens", dict(exit_layer="L", draft_precision="int8"), dict(draft_len=6, lookup=False)),
    "lens_e8_chain": ("lens", dict(exit_layer=8), dict(draft_len=3, lookup=False)),
    "lookup": (None, {}, dict(lookup=True, lookup_mode="branch")),
    "lens_e8+lookup": ("lens", dict(exit_layer=8), dict(tree="dynamic", tree_nodes=8, draft_len=4, lookup=True,
                                                         lookup_mode="branch")),
}


def old_package(commit: str, root: Path) -> Path:
    """`selfspec/` and `conf/` of `commit` under root, the package renamed selfspec_old (imports rewritten)."""
    repo = Path(__file__).resolve().parents[1]
    archive = subprocess.run(["git", "-C", str(repo), "archive", commit, "selfspec", "conf"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    (root / "selfspec").rename(root / "selfspec_old")
    for path in (root / "selfspec_old").rglob("*.py"):
        text = path.read_text()
        text = re.sub(r"\bselfspec\.", "selfspec_old.", text).replace("from selfspec import", "from selfspec_old import")
        path.write_text(text)
    return root


MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def prompts(path: str, per_task: int) -> list[str]:
    """The first turns of the first `per_task` prompts of each Spec-Bench task, in file order (MT-bench's eight
    categories are one task), as `python -m selfspec.eval prompts=spec_bench prompts.limit=N` picks them."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    seen: dict[str, int] = {}
    out = []
    for r in rows:
        cat = r.get("category", "")
        cat = "mt_bench" if cat in MT_BENCH else cat
        if seen.get(cat, 0) < per_task:
            seen[cat] = seen.get(cat, 0) + 1
            out.append(r["turns"][0])
    return out


def load(pkg: str, method: str, model: str):
    """(the model with the method's head, that package's DecodeConfig, the method's decode keys)."""
    api = importlib.import_module(f"{pkg}.api")
    decode_config = importlib.import_module(f"{pkg}.decoding.config").DecodeConfig
    head, opts, keys = METHODS[method]
    m = api.SelfSpecModel.from_pretrained(model, head="default" if head == "default" else None)
    if head == "lens":
        E = m.backbone.num_layers if opts["exit_layer"] == "L" else opts["exit_layer"]
        m.set_head("lens", exit_layer=E, draft_precision=opts.get("draft_precision"))
    return m, decode_config, keys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("commit")
    ap.add_argument("--prompts", required=True, help="Spec-Bench question.jsonl (or any file of {category, turns})")
    ap.add_argument("--per-task", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    root = Path(tempfile.mkdtemp(prefix="ab_commit_"))
    sys.path.insert(0, str(old_package(a.commit, root)))
    texts = prompts(a.prompts, a.per_task)
    report = {}
    for method in a.methods.split(","):
        models = {pkg: load(pkg, method, a.model) for pkg in ("selfspec", "selfspec_old")}
        seconds = {"selfspec": 0.0, "selfspec_old": 0.0}
        same, tokens = 0, 0
        for i, text in enumerate(texts):
            order = ("selfspec", "selfspec_old") if i % 2 == 0 else ("selfspec_old", "selfspec")
            out = {}
            for pkg in order:
                m, DecodeConfig, keys = models[pkg]
                cfg = DecodeConfig(max_new_tokens=a.new_tokens, **keys) if method != "shipped" else None
                t = time.perf_counter()
                r = m.generate(text, chat=True, max_new_tokens=a.new_tokens) if cfg is None else m.generate(text, chat=True, decode=cfg)
                seconds[pkg] += time.perf_counter() - t
                out[pkg] = r.token_ids
            same += out["selfspec"] == out["selfspec_old"]
            tokens += len(out["selfspec"])
        ratio = seconds["selfspec"] / seconds["selfspec_old"]
        report[method] = dict(prompts=len(texts), identical=same, tokens=tokens, new_over_old_seconds=round(ratio, 4))
        print(f"{method:18s} identical {same}/{len(texts)}  tokens {tokens}  new/old seconds {ratio:.3f}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
