"""Moved to praisonai_accel.data.chat_masking (and data.masking_check); kept for the modules not yet updated."""

from .data.chat_masking import *  # noqa: F401,F403
from .data.chat_masking import IGNORE_INDEX, end_of_turn_token, special_strings, template_name  # noqa: F401
from .data.masking_check import MaskingReport, check_masking  # noqa: F401
