"""Several processes and their lifetime: a save_state called on the main process alone (named or handed to the
next step: every_process, deferred_save), the end of training that must leave the process group for a later save
(end_training), DeepSpeed's CPU shared-memory segments unlinked once every rank has opened them
(shm_segments), and work the main process does for all, its outcome or its error on every process (main_decides).

May use: the ground.
"""
