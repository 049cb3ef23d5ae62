"""Training and validation data sources."""
