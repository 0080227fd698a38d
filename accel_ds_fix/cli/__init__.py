"""The command line (``python -m accel_ds_fix``: report, plan, build-ops, get-libaio,
convert-checkpoint): argument parsing and
printing only; every answer comes from the library.

May use: every part.
"""
