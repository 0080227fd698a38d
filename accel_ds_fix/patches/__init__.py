"""Wrappers that exist for one accelerate or DeepSpeed version or one upstream bug (old accelerate, ZeRO-3
loading and dtypes, GPU block release, end_training, clipping, config paths, CPU optimizer threads, DeepSpeed's
CPU shared-memory segments); each module says which. They are put on and taken off through instrumentation.PATCHES
or called from merge.prepare.

May use the top-level modules only.
"""
