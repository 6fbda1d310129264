"""The few error types the CLI and the server translate into one-line messages."""


class PosttrainError(Exception):
    """Base class: every error a user can cause, with a message fit for one line."""


class ModelFormatError(PosttrainError):
    """A model file or directory is missing, corrupt or of the wrong format."""


class ContextLengthError(PosttrainError):
    """A prompt does not fit the model's context under the active cache policy."""
