"""Pieces shared by the loader and the proxy. Knows nothing of either."""
