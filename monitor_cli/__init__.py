"""``marduk monitor``: publish device health events, inspect the map, watch the controller."""
