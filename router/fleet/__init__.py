"""The replicas: who they are, their health and engine gauges, and the HTTP client to them."""
