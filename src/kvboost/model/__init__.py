"""Model forwards: probing cache shapes and running tokens over a Cache."""
