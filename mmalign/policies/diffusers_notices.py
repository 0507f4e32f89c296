"""diffusers' log notices that name nothing to act on, filtered where the diffusers components load
(`quiet_diffusers_fp32_notice`); `mmalign.app.console` re-exports it for the planner."""

from __future__ import annotations

import logging
import re

__all__ = ["quiet_diffusers_fp32_notice"]

_EMPTY_FP32_NOTICE = re.compile(r"There are modules in \w+ that should be kept in float32: \[\]")
_DIFFUSERS_MODELING_LOGGER = "diffusers.models.modeling_utils"


class EmptyFp32NoticeFilter(logging.Filter):
    """Drops diffusers' "should be kept in float32: []" notice (an empty list); every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _EMPTY_FP32_NOTICE.match(record.getMessage())


def quiet_diffusers_fp32_notice() -> None:
    """Stop diffusers printing ``There are modules in SD3Transformer2DModel that should be kept in float32: []``.

    diffusers' ``ModelMixin.to`` logs that notice on every call that names a dtype, even ``dtype=None`` and even
    when the model keeps no module in float32 (the list is empty): ``save_lora_adapter`` calls
    ``self.to(dtype=None)`` on every LoRA save, and the planner casts its meta models. The notice then names
    nothing to act on. This adds a filter to diffusers' ``diffusers.models.modeling_utils`` logger that drops
    the notice when its list is empty; the notice with modules in the list, and every other record of that
    logger, still print. Calling it again adds nothing."""
    logger = logging.getLogger(_DIFFUSERS_MODELING_LOGGER)
    if not any(isinstance(f, EmptyFp32NoticeFilter) for f in logger.filters):
        logger.addFilter(EmptyFp32NoticeFilter())
