"""The router's gRPC API: router.proto and its generated modules (committed; see generate.py)."""
