"""``marduk agent run``: the pod's main process, which starts, watches and restarts the
trainers; its pure rules and its shell. See docs/architecture.md.
"""
