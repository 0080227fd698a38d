# The code of accel_ds_fix.pth, run by `site` at every Python start-up (setup.py turns this file into that
# one line, executed in a namespace of its own). It must stay cheap and never break start-up: it only reads
# ACCEL_DS_FIX; when that turns the fix on, it leaves a finder on sys.meta_path that imports accel_ds_fix the
# first time accelerate or deepspeed is imported (a process that never imports them pays nothing more), and a
# failure to activate is reported on stderr instead of raised.
import os
import sys

ON = ("1", "true", "yes", "on")
OFF = ("", "0", "false", "no", "off")


class ActivateAccelDsFix:
    """A meta path finder that finds nothing: its one job is to import accel_ds_fix before accelerate or
    deepspeed is imported, and then to leave sys.meta_path."""

    def find_spec(self, name, path=None, target=None):
        if name in ("accelerate", "deepspeed"):
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            try:
                import accel_ds_fix  # noqa: F401
            except Exception as exc:
                sys.stderr.write(f"accel_ds_fix: ACCEL_DS_FIX is set, but the fix could not be activated: {exc!r}\n")
        return None


# Only where setup.py's .pth line runs this code (that namespace's __name__); imported as accel_ds_fix.pth_file
# (for ON and OFF) it does nothing.
if __name__ == "accel_ds_fix_pth":
    value = os.environ.get("ACCEL_DS_FIX", "").strip().lower()
    if value in ON:
        if "accelerate" in sys.modules or "deepspeed" in sys.modules:
            ActivateAccelDsFix().find_spec("accelerate")
        elif not any(type(f).__name__ == "ActivateAccelDsFix" for f in sys.meta_path):  # a venv's lib64 -> lib
            sys.meta_path.insert(0, ActivateAccelDsFix())
    elif value not in OFF and not os.environ.get("ACCEL_DS_FIX_WARNED"):
        os.environ["ACCEL_DS_FIX_WARNED"] = "1"  # launched child processes inherit it: said once per launch
        sys.stderr.write(
            f"accel_ds_fix: ACCEL_DS_FIX={os.environ['ACCEL_DS_FIX']!r} is not understood, so the fix stays off. "
            f"Use one of {', '.join(ON)} to turn it on, or one of {', '.join(repr(v) for v in OFF)} (or unset) for off.\n"
        )
