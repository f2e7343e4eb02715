"""Tests: see tests/conftest.py for the tiers."""
