"""fleet_worker."""
