"""What a launch and an older accelerate need before any model exists: a DeepSpeed config file the launcher cannot
find (launch_config), accelerate 0.15 - 0.17 brought to what later releases do (old_accelerate), CPU threads for
DeepSpeed's CPU optimizer (cpu_threads), and the start-up costs cut: py-cpuinfo asked once a machine
(cpu_info_once), no bitsandbytes import to compare an optimizer with its classes (bnb_probe).

May use: the ground.
"""
