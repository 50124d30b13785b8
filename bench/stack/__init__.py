"""The local stack: kvrouter's topology as processes on loopback (its config, layout and
process group, ``python -m bench.stack``), the throwaway Redis deployments and ports it and
the tests use, and ``kvrouter demo``, which runs it."""
