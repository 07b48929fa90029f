"""fleet_shared."""
