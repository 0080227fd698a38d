"""`python -m accel_ds_fix [plan ...]`: see accel_ds_fix/cli/commands.py."""

import sys

from .cli.commands import main

sys.exit(main())
