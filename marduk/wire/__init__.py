"""The wire contract: every message (msgspec Structs) and every subject. See
docs/architecture.md.
"""
