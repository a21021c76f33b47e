"""Live serving: token-exact generation, sessions and next-state pairing, weight sync, shutdown, replicas."""
