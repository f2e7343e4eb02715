"""Marduk: a fault-tolerance control plane for accelerator training jobs.

This package holds the controller, the wire protocol and the pure core. Importing it is cheap
and pulls in neither the CLI nor the controller: ``marduk.cli`` and ``marduk.controller`` are
imported only where they are used.
"""

__version__ = "0.1.0"
