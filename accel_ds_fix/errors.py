"""The exception types this package raises. Every message names the problem and how to fix it."""


class MergeError(ValueError):
    """A ``prepare()`` call whose models cannot be merged into one DeepSpeed engine."""


class ConfigError(ValueError):
    """A DeepSpeed or accelerate configuration that cannot work as given."""


class MemoryPlanError(MemoryError):
    """A training that cannot fit the machine's GPU or host memory with the DeepSpeed config given."""


class PrerequisiteError(RuntimeError):
    """A DeepSpeed config this machine cannot run (NVMe offload without libaio or a direct-I/O folder)."""


class CheckpointError(RuntimeError):
    """A checkpoint that is not whole (partial, mixed or altered), or a save_state that could not finish."""
