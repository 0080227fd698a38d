"""DeepSpeed's JIT-compiled C++ ops: where they are built and whether they are, libaio for async_io without root,
the notice of a first build, and the symbol scope of the pin_memory op.

May use: the ground.
"""
