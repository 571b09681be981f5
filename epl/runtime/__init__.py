"""Session integration: rewrite trigger, session config, fetch mapping, replica sync."""
