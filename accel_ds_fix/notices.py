"""Messages a user must see: through the `accel_ds_fix` logger where the script shows its records, else on stderr.

Training scripts often configure no logging at all, or only WARNING; a merge or a minutes-long build that is
only logged at INFO would then be invisible.
"""

import logging
import sys

logger = logging.getLogger("accel_ds_fix")
_said = set()


def say(message, level=logging.INFO, once_key=None):
    """Log ``message``; write it to stderr instead when no handler would show it. ``once_key``: say it once."""
    if once_key is not None:
        if once_key in _said:
            return
        _said.add(once_key)
    if logger.isEnabledFor(level) and logger.hasHandlers():
        logger.log(level, message)
    else:
        sys.stderr.write(f"accel_ds_fix: {message}\n")
        sys.stderr.flush()
