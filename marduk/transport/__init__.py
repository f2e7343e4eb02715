"""NATS: connecting, credentials and roles, the embedded nats-server. See
docs/architecture.md.
"""
