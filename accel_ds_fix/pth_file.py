# The code of accel_ds_fix.pth, run by `site` at every Python start-up (setup.py turns this file into that
# one line). It must stay cheap and must never break start-up: with ACCEL_DS_FIX unset it only reads the
# environment, and a failure to activate is reported on stderr instead of raised.
import os

if os.environ.get("ACCEL_DS_FIX", "").strip().lower() not in ("", "0", "false", "no", "off"):
    try:
        import accel_ds_fix
    except Exception as exc:
        import sys

        sys.stderr.write(f"accel_ds_fix: ACCEL_DS_FIX is set, but the fix could not be activated: {exc!r}\n")
