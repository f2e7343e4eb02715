"""The pure core: the device-replica map, the restart policy and its rules. No I/O, no clock.
See docs/architecture.md.
"""
