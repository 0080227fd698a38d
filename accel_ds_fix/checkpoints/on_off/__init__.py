"""A checkpoint resumed with DeepSpeed switched on or off (issue 41): one that save_state wrote under DeepSpeed with
merged models, loaded by the same script under plain accelerate (to_plain), and one that plain accelerate wrote,
loaded under DeepSpeed with merged models (from_plain); the files of plain accelerate's checkpoints and the Adam
states both sides keep (plain_files).

Part of checkpoints: May use: the ground, processes, weights, merge, checkpoints.
"""
