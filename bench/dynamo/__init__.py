"""NVIDIA Dynamo's KV router as a benchmark arm: its model directory, adapters and frontends."""
