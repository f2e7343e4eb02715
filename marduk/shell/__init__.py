"""Process helpers shared by every command: CLI options, logging, running a main coroutine.
See docs/architecture.md.
"""
