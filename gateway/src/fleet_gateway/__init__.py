"""fleet_gateway."""
