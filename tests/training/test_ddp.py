"""Data-parallel training on DistributedDataParallel (issue 23, item 4): two processes under torchrun (gloo on CPU)
build the data together (data=mix too), each computes only its part of the feature cache, and they train the head
that one process trains on the same global batches, within float tolerance."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TINY = ["experiment=tiny", "+model.random_init.initializer_range=0.3", "data.val_prompts=2", "decode.max_new_tokens=8",
        "logger=none", "trainer.max_steps=4", "trainer.grad_accum=2", "trainer.ckpt_every=0", "trainer.warmup_steps=1"]


def _env(cache: Path) -> dict:
    e = dict(os.environ)
    e.update(SELFSPEC_CACHE=str(cache), HF_HUB_OFFLINE="1", WANDB_MODE="offline", PYTHONUNBUFFERED="1",
             TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return e


def _train(args: list[str], run_dir: Path, cache: Path, procs: int = 1) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"] if procs > 1 \
        else [sys.executable]
    cmd = [*launcher, "-m", "selfspec.train", *args, f"hydra.run.dir={run_dir}"]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(cache), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def _head(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "head" / "head.safetensors"))


def test_two_processes_train_the_one_process_head(tmp_path: Path) -> None:
    from selfspec.training.dataset import DATASET_FILE, Sequences
    from selfspec.training.features import hidden_path

    cache = tmp_path / "cache"
    two = _train(TINY, tmp_path / "two", cache, procs=2)
    # each rank answered its own share of the prompts (synthesis.generate under distributed.sharding)
    out = two.stdout + two.stderr
    assert "rank 0 of 2" in out and "rank 1 of 2" in out, out[-3000:]
    data_dir = next(cache.glob(f"data/*/*/{DATASET_FILE}")).parent
    data = Sequences.load(data_dir / DATASET_FILE)
    # each rank computed and cached only its part of the layer-E states: the sequences b with b % 2 == rank
    parts = [torch.load(hidden_path(data_dir, 2, "float16", (r, 2)), weights_only=True) for r in (0, 1)]
    lengths = (data.seq_offsets[1:] - data.seq_offsets[:-1]).tolist()
    assert [p.shape[0] for p in parts] == [sum(lengths[r::2]) for r in (0, 1)]
    assert not hidden_path(data_dir, 2, "float16").exists()  # nobody loaded or wrote the whole file

    one = tmp_path / "one"
    _train(TINY, one, cache)  # the same cache: the data the two ranks built
    whole = torch.load(hidden_path(data_dir, 2, "float16"), weights_only=True)
    for r in (0, 1):  # a rank's part holds the same states as the whole file, sequence by sequence
        rows = torch.cat([torch.arange(int(data.seq_offsets[b]), int(data.seq_offsets[b + 1])) for b in range(r, len(lengths), 2)])
        torch.testing.assert_close(parts[r], whole[rows], rtol=2e-3, atol=2e-3)  # float16 ulps
    a, b = _head(tmp_path / "two"), _head(one)
    assert a.keys() == b.keys() and any(not torch.equal(a[k], torch.zeros_like(a[k])) for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)

    # the data two ranks build is the data one process builds (answers are batch- and rank-independent)
    fresh = tmp_path / "fresh"
    _train([*TINY, "trainer.max_steps=1", "trainer.grad_accum=1"], tmp_path / "single", fresh)
    alone = Sequences.load(next(fresh.glob(f"data/*/*/{DATASET_FILE}")))
    assert torch.equal(alone.tokens, data.tokens) and torch.equal(alone.topk_ids[:, 0], data.topk_ids[:, 0])
    torch.testing.assert_close(alone.topk_logprobs, data.topk_logprobs, atol=2e-3, rtol=2e-3)  # float16 ulps


def test_a_rank_part_of_the_features_is_indexed_like_the_whole(tiny_llama) -> None:
    from selfspec.training.dataset import Sequences
    from selfspec.training.features import HiddenPart, compute_hidden, part_index, part_sequences

    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(0, 250, (int(n),), generator=g).tolist(), torch.randint(0, 250, (4,), generator=g).tolist())
             for n in torch.randint(2, 9, (7,), generator=g)]
    targets = [(torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 2)) for _ in pairs]
    data = Sequences.from_pairs(pairs, targets, ["v"], [], {})
    whole = compute_hidden(tiny_llama.backbone, data, 2, torch.float32, progress=False)
    for rank in (0, 1, 2):
        seqs = part_sequences(data, rank, 3)
        part = HiddenPart(compute_hidden(tiny_llama.backbone, data, 2, torch.float32, progress=False, sequences=seqs),
                          part_index(data, seqs))
        for b in seqs:
            s, e = data.seq_offsets[b], data.seq_offsets[b + 1]
            torch.testing.assert_close(part[s:e], whole[s:e], rtol=1e-3, atol=1e-4)  # other batches, other rounding
        positions = torch.cat([torch.arange(int(data.seq_offsets[b]), int(data.seq_offsets[b + 1])) for b in seqs])
        torch.testing.assert_close(part[positions.flip(0)], whole[positions.flip(0)], rtol=1e-3, atol=1e-4)  # other batches, other rounding
        other = next(b for b in range(data.num_sequences) if b % 3 != rank)
        with pytest.raises(IndexError):
            part[data.seq_offsets[other] : data.seq_offsets[other + 1]]


def test_a_rank_loss_is_its_share_of_the_batch_mean() -> None:
    """distill_loss with the whole batch's counts: the parts' losses add up to the whole batch's mean loss."""
    from selfspec.training.loss import distill_loss, loss_counts

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(10, 6, generator=g)
    ids = torch.randint(-1, 6, (10, 3), generator=g)
    ids[0] = -1  # a row without target mass in the vocabulary
    lp = torch.randn(10, 3, generator=g).log_softmax(-1)
    labels = torch.randint(-1, 6, (10,), generator=g)
    whole, st = distill_loss(logits, ids, lp, labels, 2.0, 0.5)
    counts = loss_counts(ids, labels)
    parts = [distill_loss(logits[s], ids[s], lp[s], labels[s], 2.0, 0.5, counts) for s in (slice(0, 3), slice(3, 10))]
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole)
    for key in ("soft", "hard", "acc"):
        torch.testing.assert_close(parts[0][1][key] + parts[1][1][key], st[key])


# One data=mix build through load_or_build, as training runs it: under torchrun every rank calls it (gloo on CPU).
MIX_JOB = """
import json, logging, sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])  # tests/: conftest's tiny models, training/test_ddp.py's settings
from training.test_ddp import build_mix
from selfspec.training.distributed import init_distributed, shutdown

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
dist = init_distributed("cpu")
data, directory, cached = build_mix(Path(sys.argv[1]), sys.argv[2], dist)
# each rank writes its own file: two ranks printing to one pipe can interleave their lines
(Path(sys.argv[4]) / f"rank{dist.rank}.json").write_text(
    json.dumps({"rank": dist.rank, "dir": str(directory), "cached": cached, "sequences": data.num_sequences}))
shutdown(dist)
"""


def build_mix(cache: Path, prompts: str, dist=None):
    """A small data=mix dataset of the tiny llama (prompt files, Magpie prompts, follow-up turns) through load_or_build.
    -> (data, its dir, was cached)."""
    from conftest import tiny_spec
    from selfspec.api import SelfSpecModel
    from selfspec.model.loading import ModelConfig
    from selfspec.training.config import DataConfig
    from selfspec.training.dataset import load_or_build

    model = SelfSpecModel.from_pretrained(ModelConfig(name="tiny-llama", random_init=tiny_spec("llama"), seed=0,
                                                      device="cpu"), head=None)
    cfg = DataConfig(source="mix", num_prompts=16, val_prompts=3, prompt_max_tokens=8, answer_max_tokens=8, topk=4,
                     mix={"weights": {"magpie": 1, "files": 2, "multiturn": 1}, "files": [prompts], "shard_prompts": 3,
                          "exclude": []})
    return load_or_build(model, cfg, cache, "tiny-llama", progress=False, dist=dist)


def test_two_processes_build_the_one_process_mix(tmp_path: Path) -> None:
    """data=mix under torchrun (issue 23): the prompts are chosen on rank 0, every rank answers its share, rank 0 alone
    writes the answer shards (the other rank's answers too) and the dataset; the data is what one process builds."""
    from selfspec.training.dataset import DATASET_FILE, Sequences
    from selfspec.utils.tensors import safe_torch_load

    job, prompts = tmp_path / "mix_job.py", tmp_path / "prompts.jsonl"
    job.write_text(MIX_JOB)
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "chat", "turns": [f"Tell me about topic {i}.", "Why?"]})
                                 for i in range(12)) + "\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(job),
           str(tmp_path / "two"), str(prompts), str(ROOT / "tests"), str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path / "two"), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert sorted(r["rank"] for r in ranks) == [0, 1] and not any(r["cached"] for r in ranks)
    assert len({r["dir"] for r in ranks}) == 1 and len({r["sequences"] for r in ranks}) == 1
    work = {int(r): int(k) for r, k, _ in re.findall(r"rank (\d) of 2 continues (\d+) of (\d+) prompts", p.stderr)}
    assert set(work) == {0, 1} and all(work.values()), p.stderr[-3000:]  # both ranks answered prompts
    mix_dir = Path(ranks[0]["dir"]) / "mix"
    held = set()
    for shard in (mix_dir / "answers-1").glob("shard-*.pt"):
        held |= set(safe_torch_load(shard)["index"].tolist())
    assert held == set(range(len(json.loads((mix_dir / "stage1.json").read_text())["train"])))  # every rank's answers

    alone, alone_dir, _ = build_mix(tmp_path / "one", str(prompts))  # one process, this one
    two = Sequences.load(Path(ranks[0]["dir"]) / DATASET_FILE)
    one = Sequences.load(alone_dir / DATASET_FILE)
    assert two.val_prompts == one.val_prompts and two.train_prompts == one.train_prompts
    assert torch.equal(two.tokens, one.tokens) and torch.equal(two.topk_ids[:, 0], one.topk_ids[:, 0])
    torch.testing.assert_close(two.topk_logprobs, one.topk_logprobs, atol=2e-3, rtol=2e-3)  # float16 ulps
