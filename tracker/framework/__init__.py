"""The process framework every kvrouter process uses: settings from flags and env, the
``kvrouter`` command, structured logs, HTTP serving and its request plumbing, a service's
life in its process, and the error tree.
"""
