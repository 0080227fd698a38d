"""`python -m accel_ds_fix [plan ...]`: see accel_ds_fix/cli.py."""

import sys

from .cli import main

sys.exit(main())
