"""head=auto: the shipped drafting setting that should run fastest on this machine.

Which draft pays depends on the hardware. On a CPU a step is bound by the bytes it reads, so the model's own
int4/int8 copy through all layers costs 0.25-0.3 of a step and, agreeing 98% of the time, wins; on a GPU a step is
bound by kernel launches, a full-depth draft costs about a whole step, and a cheap head at a low exit layer wins.

So the choice is made from two measurements that live in different places:
- each candidate's **profile** (what it buys per verify step: tau, its draft passes, its verify rows), measured on
  Spec-Bench by an eval run (`eval/auto_profiles.py`) and stored in the shipped default head's head_config.json
  ("auto": {"candidates": [...]}); it depends on the drafts, not on the machine;
- each candidate's **step costs on this machine** (a draft pass c and a verify of its rows v, in autoregressive
  steps; decoding/costs.py: StepTimer, the same timer decode.tree=auto calibrates with), measured at first use and
  cached per machine under $SELFSPEC_CACHE/auto/.
The predicted speedup of a candidate is tau / (draft_passes * c + v(verify_rows)) (decoding only: prefill, which
every method pays, is left out), and the best one is chosen. `AutoChoice.reason` says what was chosen and why; the
API keeps it on the model (`SelfSpecModel.auto_choice`, and each output's `decode_source`), eval in summary.md and
the result record.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from selfspec.decoding.costs import StepTimer
from selfspec.errors import SelfSpecError, check
from selfspec.heads.config import HeadConfig
from selfspec.model import cpu_kernels
from selfspec.heads.saving import CONFIG_FILE, DEFAULT_HEAD, build_head, load_head, shipped_head_for, shipped_or_path
from selfspec.utils.io import atomic_write_json
from selfspec.utils.machine import cpu_identity
from selfspec.utils.paths import cache_dir

log = logging.getLogger(__name__)

AUTO_HEAD = "auto"
COST_CONTEXT = 300  # the timed steps' context: about a Spec-Bench prompt plus its answer so far
COST_REPEATS = 15
COSTS_VERSION = 3  # how the costs are measured: a cached measurement of another version is measured again
# Within 3% of the best counts as a tie, and the earlier candidate (the shipped default first) wins: two measurements
# of the same costs on one quiet EPYC put the int4_mlp and int8 self-drafts 2-3% apart, in either order.
TIE = 0.03


@dataclass(frozen=True)
class Profile:
    """What a candidate buys per verify step, measured by an eval run: tokens committed (tau), draft passes of its
    head (0 for context lookup's rounds) and rows verified (the round's drafts plus one)."""

    tau: float
    draft_passes: float
    verify_rows: float
    source: str = ""


@dataclass(frozen=True)
class Candidate:
    """One drafting setting that ships: `head` a shipped head's name ("default": this model's) or None (context
    lookup alone), an optional draft precision, decode settings beside the head's own, and its profile."""

    name: str
    head: str | None
    profile: Profile
    draft_precision: str | None = None
    decode: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Costs:
    """A candidate's steps on this machine, in autoregressive steps: one draft pass, and a verify of its rows."""

    draft: float
    verify: float


@dataclass
class AutoChoice:
    candidate: Candidate
    table: list[dict]  # per candidate: name, tau, draft_passes, verify_rows, c, v, predicted
    costs_source: str  # "measured" | "cached" | "given"
    reason: str

    def as_dict(self) -> dict:
        return {"chosen": self.candidate.name, "head": self.candidate.head,
                "draft_precision": self.candidate.draft_precision, "decode": dict(self.candidate.decode),
                "costs": self.costs_source, "reason": self.reason, "table": self.table}


# ------------------------------------------------------------------------------------------------ candidates
def candidates_for(backbone) -> list[Candidate]:
    """The candidates the shipped default head of this model lists (its head_config.json "auto" block); [] when
    no head ships for the model or it lists none."""
    found = shipped_head_for(backbone)
    if found is None:
        return []
    data = json.loads((Path(found) / CONFIG_FILE).read_text(encoding="utf-8"))
    return parse_candidates(data.get("auto") or {}, f"{found}/{CONFIG_FILE}")


def parse_candidates(block: dict, where: str) -> list[Candidate]:
    check(isinstance(block, dict), f"{where}: 'auto' must be an object")
    out = []
    for i, c in enumerate(block.get("candidates") or []):
        at = f"{where}: auto.candidates[{i}]"
        check(isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("profile"), dict),
              f"{at}: needs a name and a profile")
        p = c["profile"]
        nums = [p.get(k) for k in ("tau", "draft_passes", "verify_rows")]
        check(all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 for x in nums)
              and nums[0] >= 1 and nums[2] >= 1, f"{at}.profile: tau >= 1, draft_passes >= 0, verify_rows >= 1")
        check(c.get("head") is None or isinstance(c.get("head"), str), f"{at}.head: a shipped head's name or null")
        check(isinstance(c.get("decode", {}), dict), f"{at}.decode: an object of decode settings")
        out.append(Candidate(c["name"], c.get("head"), Profile(*map(float, nums), str(p.get("source", ""))),
                             c.get("draft_precision"), dict(c.get("decode") or {})))
    return out


def head_ref(backbone, candidate: Candidate) -> str | None:
    """The candidate's head as a directory (None: no head)."""
    if candidate.head is None:
        return None
    if candidate.head == "default":
        return str(shipped_head_for(backbone))
    return str(shipped_or_path(candidate.head))


# ------------------------------------------------------------------------------------------------ the choice
def predicted(profile: Profile, costs: Costs) -> float:
    """Decode-only speedup over our AR path: tokens per step over a step's cost in AR steps."""
    cost = profile.draft_passes * costs.draft + costs.verify
    return profile.tau / cost if cost > 0 else 0.0


def choose(cands: list[Candidate], costs: dict[str, Costs], source: str = "given") -> AutoChoice:
    """The candidate with the best predicted speedup (within TIE of the best: the earlier one)."""
    check(len(cands) > 0, "head=auto: no candidates")
    table = []
    for c in cands:
        k = costs[c.name]
        table.append({"name": c.name, "tau": c.profile.tau, "draft_passes": c.profile.draft_passes,
                      "verify_rows": c.profile.verify_rows, "c": round(k.draft, 4), "v": round(k.verify, 4),
                      "predicted": round(predicted(c.profile, k), 4)})
    best = max(r["predicted"] for r in table)
    i = next(i for i, r in enumerate(table) if r["predicted"] >= best * (1 - TIE))
    others = ", ".join(f"{r['name']} {r['predicted']:.2f}x" for j, r in enumerate(table) if j != i)
    r = table[i]
    reason = (f"head=auto chose {r['name']}: predicted {r['predicted']:.2f}x our AR path on this machine (tau "
              f"{r['tau']:.2f} per step at {r['draft_passes']:.2f} draft passes of c={r['c']:.3f} and a verify of "
              f"{r['verify_rows']:.1f} rows costing v={r['v']:.3f} steps; costs {source}); the others: {others}")
    return AutoChoice(cands[i], table, source, reason)


# ------------------------------------------------------------------------------------------------ costs
def _load(backbone, candidate: Candidate):
    ref = head_ref(backbone, candidate)
    if ref is None:
        return None
    head = load_head(ref, backbone)
    head.set_draft_precision(candidate.draft_precision)
    return head


def measure_costs(backbone, cands: list[Candidate], context: int = COST_CONTEXT, repeats: int = COST_REPEATS) -> dict[str, Costs]:
    """Each candidate's draft pass (through its own drafter: a fused chain's share per draft) and the verify of its
    rows (linear between the two whole row counts around its mean; the whole stack, or layers >= E where the engine
    reuses the draft's layers < E)."""
    context = max(1, min(context, backbone.max_positions - 20))
    rows = max(math.ceil(c.profile.verify_rows) for c in cands)
    timer = StepTimer(backbone, context, max(rows, 2), repeats, warmup=2)
    out, verify = {}, {}  # verify[(E or None, K)]: one timing per distinct verify step, shared by candidates

    def v_at(reuse_e, k):
        if (reuse_e, k) not in verify:
            reuse = build_head(HeadConfig(type="lens", exit_layer=reuse_e), backbone) if reuse_e is not None else None
            verify[(reuse_e, k)] = timer.ratio(timer.verify_step(k, reuse))
        return verify[(reuse_e, k)]

    for c in cands:  # heads load outside inference mode: their weights must stay plain tensors (the timer's steps
        head = _load(backbone, c)  # run in inference mode themselves)
        draft = timer.draft_cost(head, head.exit_layer) if head is not None and c.profile.draft_passes > 0 else 0.0
        # verification as the engine runs it: the whole stack, or layers >= E when the draft's layers < E are reused
        reuse_e = head.verify_reuse if head is not None else None
        lo = int(math.floor(c.profile.verify_rows)) - 1
        frac = c.profile.verify_rows - 1 - lo
        v = v_at(reuse_e, lo) if frac < 1e-6 else (1 - frac) * v_at(reuse_e, lo) + frac * v_at(reuse_e, lo + 1)
        out[c.name] = Costs(draft, v)
    return out


def _cache_key(backbone, cands: list[Candidate]) -> dict:
    cpu = cpu_identity()
    lib = cpu_kernels.library_path().name if backbone.device.type == "cpu" else None
    return {"version": COSTS_VERSION, "cpu": [cpu["model_name"], cpu["family"], cpu["model"], cpu["flags"]], "threads": torch.get_num_threads(),
            "device": str(backbone.device), "gpu": torch.cuda.get_device_name(0) if backbone.device.type == "cuda" else None,
            "dtype": str(backbone.dtype), "torch": torch.__version__, "kernels": lib,
            "model": [backbone.num_layers, backbone.hidden_size, backbone.vocab_size],
            "candidates": [[c.name, c.head, c.draft_precision, sorted(c.decode.items()), c.profile.verify_rows]
                           for c in cands]}


def machine_costs(backbone, cands: list[Candidate], use_cache: bool = True) -> tuple[dict[str, Costs], str]:
    """The candidates' costs on this machine: from the per-machine cache when it holds them, else measured (a few
    seconds) and cached. -> (costs by name, "cached" | "measured")."""
    key = _cache_key(backbone, cands)
    path = cache_dir() / "auto" / (hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16] + ".json")
    if use_cache and path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("key") == json.loads(json.dumps(key, default=str)):
                costs = {n: Costs(float(v["draft"]), float(v["verify"])) for n, v in data["costs"].items()}
                if set(costs) == {c.name for c in cands} and all(math.isfinite(x.draft + x.verify) for x in costs.values()):
                    return costs, "cached"
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged or foreign file: measured again below
        log.warning("head=auto: the cached step costs %s do not apply; measuring them again", path)
    costs = measure_costs(backbone, cands)
    try:
        atomic_write_json(path, {"key": key, "costs": {n: asdict(c) for n, c in costs.items()}}, default=str)
    except OSError as exc:  # a read-only cache: measured every time, still correct
        log.warning("head=auto: cannot cache the step costs (%s)", exc)
    return costs, "measured"


def resolve_auto(backbone, costs: dict[str, Costs] | None = None) -> AutoChoice | None:
    """head=auto for this model: the chosen candidate and why, or None when nothing ships for the model (the caller
    then takes head=default's fallback)."""
    cands = candidates_for(backbone)
    if not cands:
        return None
    source = "given"
    if costs is None:
        costs, source = machine_costs(backbone, cands)
    missing = [c.name for c in cands if c.name not in costs]
    if missing:
        raise SelfSpecError(f"head=auto: no step costs for {missing}")
    choice = choose(cands, costs, source)
    log.info("%s", choice.reason)
    return choice


def auto_head_config(backbone, hcfg, costs: dict[str, Costs] | None = None):
    """head.path=auto -> (the chosen head's HeadConfig, or None for context lookup alone; the decode settings the
    choice adds beside that head's own saved ones; the AutoChoice, or None when nothing ships for this model and
    head=default's fallback applies)."""
    choice = resolve_auto(backbone, costs)
    if choice is None:
        return replace(hcfg, path=DEFAULT_HEAD), {}, None
    c = choice.candidate
    if c.head is None:
        return None, dict(c.decode), choice
    return (replace(hcfg, path=head_ref(backbone, c), draft_precision=c.draft_precision or hcfg.draft_precision),
            dict(c.decode), choice)
