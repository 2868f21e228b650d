"""selfspec: self-speculative decoding (draft with a model's own early layers + an exit head, verify with
the full stack, exactly lossless)."""

from selfspec.api import GenerationResult, SelfSpecModel
from selfspec.decoding.config import DecodeConfig
from selfspec.errors import SelfSpecError
from selfspec.heads import HeadConfig

__all__ = ["SelfSpecModel", "GenerationResult", "DecodeConfig", "HeadConfig", "SelfSpecError"]
__version__ = "0.1.0"
