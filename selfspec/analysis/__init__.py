"""How well can layer E draft for this model, with which head? Teacher-forced analysis of exit heads on the
target's own greedy answers, without a decode loop (entry point: `python -m selfspec.analyze`).

  answers.py   the target's greedy answers, generated once with the engine and cached on disk
  heads.py     the `heads=` list (TYPE, TYPE@E, TYPE@A-B, DIR) -> heads via selfspec.heads
  scoring.py   one teacher-forced pass per sequence -> per-position events for every head
  metrics.py   agreement, top-k coverage, KL, conditional agreement, expected and replayed tau, speedup
  costs.py     draft / verify step costs with the engine's step timer
  pipeline.py  all of the above for a list of heads -> the dict analysis.json holds
  report.py    analysis.md and the PNG figures
"""

from selfspec.analysis.answers import AnswerSeq, load_or_generate
from selfspec.analysis.config import AnalysisConfig, TimingConfig
from selfspec.analysis.heads import HeadEntry, parse_heads
from selfspec.analysis.metrics import conditional_agreement, expected_tau, replay, replay_all, summarize
from selfspec.analysis.pipeline import analyze_heads, score_heads
from selfspec.analysis.scoring import PositionScores, score_sequence

__all__ = [
    "AnalysisConfig", "TimingConfig", "AnswerSeq", "load_or_generate", "HeadEntry", "parse_heads",
    "conditional_agreement", "expected_tau", "replay", "replay_all", "summarize", "analyze_heads", "score_heads",
    "PositionScores", "score_sequence",
]
