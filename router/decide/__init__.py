"""The decision core: a parsed request in, a placement out; attempts committed and finished."""
