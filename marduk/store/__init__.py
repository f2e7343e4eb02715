"""Durable state in JetStream: the key-value mirror of the policy and the health stream. See
docs/architecture.md.
"""
