"""Shared test helpers, imported as `support.<module>` (pytest puts tests/ on the path)."""
