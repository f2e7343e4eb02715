"""Imported by a fork server as --preload: starts a thread, which makes forking unsafe."""

import threading
import time

threading.Thread(target=time.sleep, args=(3600,), name="preloaded-worker", daemon=True).start()
