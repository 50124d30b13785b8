"""The scenario matrix (``kvrouter matrix``): its cells, running them, each cell's verdict
against the best real peer, and the report."""
