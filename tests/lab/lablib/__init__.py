"""Lab infrastructure behind tests/lab/labctl (stdlib only)."""
