"""`attnscope check`: run anyone's attention code and name the first stage that goes wrong."""

from .engine import check
from .mistakes import MISTAKES
from .report import CheckReport, Failure, ModelReport, StageCheck

__all__ = ["MISTAKES", "CheckReport", "Failure", "ModelReport", "StageCheck", "check"]
