"""NibbleError, which user-facing layers turn into a clean message, and its kinds."""


class NibbleError(Exception):
    """Bad input or an unmet requirement. The message says what is wrong and what to do."""


class FormatError(NibbleError):
    """A model file or directory that cannot be read."""


class UnsupportedModel(NibbleError):
    """A model that a set of kernels cannot run (a shape, a mix of quantizations): the message
    says what and what to do; the model may still run on other kernels (the GPU's on the CPU)."""
