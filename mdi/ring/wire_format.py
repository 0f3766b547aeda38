"""The int8 codec's constants and the frame error, shared by the wire (mdi.ring.wire, which
validates frames) and the codecs' two arithmetics (mdi.ring.wire_torch, mdi.ring.wire_numpy)
without either importing the other (mdi.ring.wire's docstring describes the format)."""
from mdi.model.layout import FP16_MAX  # noqa: F401  (int8 scales are clamped to it rather than becoming inf)

INT8_BLOCK = 32
INT8_OUTLIERS = 2  # per row, sent as (int16 column, float16 value): widths up to 32767
INT8_MAX_WIDTH = 32767


class FrameError(ValueError):
    """A frame that fails validation; the message says why."""


def outliers(width: int) -> int:
    """Outliers sent apart per row of `width` values."""
    return min(INT8_OUTLIERS, width)
