"""The library a trainer imports (``agent.connect``): its two clients (over NATS to the
controller, or through its supervisor), the command inbox and its options. See
docs/architecture.md.
"""
