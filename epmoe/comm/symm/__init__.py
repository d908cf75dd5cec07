"""symm: our symmetric-memory comm layer (docstring filled below)."""
