"""What every mixing strategy's validation shares: the error type and the norm tolerance."""

#: Largest allowed deviation of a column norm from 1.
COLUMN_NORM_TOLERANCE = 1e-9


class InvalidMixingMatrixError(ValueError):
    """Raised when a strategy's parameters break a constraint the privacy guarantee relies on."""
