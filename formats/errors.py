"""The one exception type that user-facing layers turn into a clean message."""


class NibbleError(Exception):
    """Bad input or an unmet requirement. The message says what is wrong and what to do."""


class FormatError(NibbleError):
    """A model file or directory that cannot be read."""
