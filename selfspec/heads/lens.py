"""The logit lens: the final norm + LM head on layer E. No parameters: the untrained baseline."""

from __future__ import annotations

from selfspec.heads.base import ExitHead
from selfspec.heads.config import HeadConfig, register_head


@register_head("lens", HeadConfig)
class LensHead(ExitHead):
    plain_readout = True
