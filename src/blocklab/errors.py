class ConfigError(ValueError):
    """A bad config or data input, detected before any work. The message names the key and the fix."""
