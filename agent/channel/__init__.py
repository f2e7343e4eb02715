"""What the trainer's library and its supervisor share: the trainer channel's messages, the
MARDUK_* hand-off and the epoch-fencing rule. See docs/architecture.md.
"""
