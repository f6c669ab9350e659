"""The one exception of the data pipeline."""
from __future__ import annotations


class DataError(ValueError):
    """A corpus, tokenizer or dataset that cannot be built or read; the message names the path and the fix."""
