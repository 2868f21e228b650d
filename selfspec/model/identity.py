"""Is the model a head was saved on the model it is loaded on? A measured answer, from the two fingerprints.

`Backbone.fingerprint()` stores the model's sizes, its output-changing config, a hash of its weight tensors'
names and shapes and FINGERPRINT_SAMPLES strided values of every weight tensor. `compare_fingerprints` reads
the samples back tensor by tensor and decides:

  same         every sampled value within one bfloat16 step: the same weights, in any dtype;
  quantized    the same model from another source or quantization (a head trained on the Q4 GGUF file loaded on
               the hub's bfloat16 safetensors, or the reverse): sizes, config and tensor shapes equal, the norm and
               bias vectors unchanged (GGUF, GPTQ, AWQ and bitsandbytes keep them in float), at least half of
               the weight matrices changed (a quantization touches them all) and a relative weight distance of
               at most MAX_DISTANCE;
  other        anything else: other sizes, config or shapes; changed norms (a full fine-tune trains them); a few
               matrices changed (a merged LoRA or an edited layer); or a larger distance (another model).

The distance is the root mean square over weight matrices of ||a - b|| / max(||a||, ||b||) on each matrix's
samples. Measured on SmolLM2-135M: 4-bit quantization (Q4_1, re-quantized at a shifted block offset) 7.5%
(8.3% at most per matrix), Q8_0 0.6%, two independent initialisations over 100%. A merged fine-tune whose every
matrix moved by less than MAX_DISTANCE and whose norms did not move looks like a quantization: the samples cannot
tell them apart. `allow_other_model` (head.allow_other_model=true) loads a head on any model whose sizes fit.

`compare_saved` compares two saved fingerprints with each other (no model loaded; export_head --average).

`weights_digest` is the exact check: a hash of every base weight, which training compares before and after.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass

import torch

from selfspec.model.backbone import FINGERPRINT_SAMPLES, _base_weights, _probe_values, fingerprints_match

MAX_DISTANCE = 0.15  # twice a 4-bit quantization's error; independent models are ~1.0 and more apart
MIN_CHANGED = 0.5  # of the weight matrices, for "another quantization" (it changes them all)
BF16_STEP = 2.0**-8  # fingerprints_match's tolerance: the same weights in another dtype
_SIZE_KEYS = ("model_type", "num_layers", "hidden_size", "vocab_size")


@dataclass
class ModelMatch:
    """How a saved fingerprint compares with a loaded model. verdict: "same" | "quantized" | "other"."""

    verdict: str
    distance: float | None = None  # relative weight distance over weight matrices (None: not measured)
    changed: float | None = None  # fraction of weight matrices that differ beyond one bfloat16 step
    reason: str = ""  # why, in words (for "other": why it is another model)

    @property
    def accepted(self) -> bool:
        return self.verdict != "other"

    def describe(self) -> str:
        measured = [f"relative weight distance {self.distance:.2%}"] if self.distance is not None else []
        if self.changed is not None:
            measured.append(f"{self.changed:.0%} of the weight matrices differ")
        return "; ".join(([self.reason] if self.reason else []) + measured)

    def to_dict(self) -> dict:
        return asdict(self)


def tensor_layout(backbone) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the weight tensors in the order fingerprint() samples them."""
    return [(name, tuple(p.shape)) for name, p in sorted(_base_weights(backbone.hf_model))]


def compare_fingerprints(saved: dict, mine: dict, layout: list[tuple[str, tuple[int, ...]]]) -> ModelMatch:
    """saved: the fingerprint a head stored; mine: the loaded model's, whose tensors are `layout`."""
    sizes = [k for k in _SIZE_KEYS if saved.get(k) != mine.get(k)]
    if sizes:
        return ModelMatch("other", reason="other sizes: " + ", ".join(f"{k} {saved.get(k)} vs {mine.get(k)}" for k in sizes))
    if saved.get("version", 1) < 2 or mine.get("version", 1) < 2:  # a head saved before the per-tensor samples
        ok = fingerprints_match(saved, mine)
        return ModelMatch("same" if ok else "other", reason="" if ok else "the embedding probe differs")
    differ = config_differences(saved.get("config") or {}, mine.get("config") or {})
    if differ:
        return ModelMatch("other", reason="other config: " + ", ".join(differ[:4]))
    if saved.get("tensors") != mine.get("tensors"):
        return ModelMatch("other", reason="other weight tensor names or shapes")
    pa, pb = _probe_values(saved), _probe_values(mine)
    n = FINGERPRINT_SAMPLES
    if pa is None or pb is None or pa.shape != pb.shape or pb.numel() != n * len(layout):
        return ModelMatch("other", reason="the saved weight samples are unreadable")
    pa, pb = pa.double().view(-1, n), pb.double().view(-1, n)  # (tensors, samples)
    close = ((pa - pb).abs() <= BF16_STEP * torch.maximum(pa.abs(), pb.abs()) + 1e-7) | (pa == pb)
    same_t = close.all(1)  # (tensors,)
    matrix = torch.tensor([len(shape) >= 2 for _, shape in layout])
    norm = torch.maximum(pa.norm(dim=1), pb.norm(dim=1)).clamp_min(1e-12)
    rel = (pa - pb).norm(dim=1) / norm  # (tensors,)
    distance = math.sqrt(float((rel[matrix] ** 2).mean())) if matrix.any() else float(rel.max())
    changed = float((~same_t[matrix]).double().mean()) if matrix.any() else 0.0
    if bool(same_t.all()):
        return ModelMatch("same", distance, changed)
    vectors = ~matrix & ~same_t
    if vectors.any():
        names = [layout[i][0] for i in vectors.nonzero()[:, 0].tolist()]
        return ModelMatch("other", distance, changed, f"norm or bias weights differ ({names[0]}{', ...' if len(names) > 1 else ''}): "
                                                      "a fine-tune (another quantization keeps them)")
    if changed < MIN_CHANGED:
        k, total = int((~same_t[matrix]).sum()), int(matrix.sum())
        return ModelMatch("other", distance, changed, f"only {k} of {total} weight matrices differ: a fine-tune or merge "
                                                      "(another quantization changes them all)")
    if distance > MAX_DISTANCE:
        return ModelMatch("other", distance, changed, f"weights further apart than another quantization (> {MAX_DISTANCE:.0%})")
    return ModelMatch("quantized", distance, changed, "the same model from another source or quantization")


def _same_value(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return not config_differences(a, b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=0.0)
    return a == b


def config_differences(a: dict, b: dict) -> list[str]:
    """The output-changing config fields that differ ("key x vs y"). Numbers are compared to float32 precision (a GGUF
    file stores rms_norm_eps=1e-5 as 9.999999747e-06); a field one side lacks counts only when the other's is not null."""
    out = []
    for k in sorted(set(a) | set(b)):
        if k not in a or k not in b:
            if (a.get(k) if k in a else b.get(k)) is not None:
                out.append(f"{k} {a.get(k, '(absent)')} vs {b.get(k, '(absent)')}")
        elif not _same_value(a[k], b[k]):
            out.append(f"{k} {a[k]} vs {b[k]}")
    return out


def compare_to_backbone(saved: dict, backbone) -> ModelMatch:
    return compare_fingerprints(saved or {}, backbone.fingerprint(), tensor_layout(backbone))


def compare_saved(a: dict, b: dict) -> ModelMatch:
    """Two saved fingerprints with no model loaded (export_head --average: were both heads saved on one model?).
    A fingerprint does not say which sampled tensors are norm or bias vectors, so every tensor counts as a matrix:
    the same weights are "same", another quantization of them "quantized" (its unchanged vectors only lower the
    distance and the changed fraction: about 7 of a llama layer's 9 tensors still change), another model "other"."""
    probe = _probe_values(b or {})
    count = probe.numel() // FINGERPRINT_SAMPLES if probe is not None else 0
    return compare_fingerprints(a or {}, b or {}, [(f"tensor {i}", (0, 0)) for i in range(count)])


def weights_digest(hf_model) -> str:
    """A hash of every base weight and buffer (LoRA matrices excluded): training must leave them bit-identical."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(hf_model.state_dict().items()):
        if "lora_" in name:
            continue
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()
