"""The one exception type this package raises for inputs it cannot merge safely."""


class MergeError(ValueError):
    """A ``prepare()`` call whose models cannot be merged into one DeepSpeed engine.

    The message always names the problem and how to fix it.
    """
