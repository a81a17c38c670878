"""Several KVBoost replicas behind one endpoint: routing requests to the replica holding their K/V (routing.py)."""
