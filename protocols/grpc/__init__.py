"""Native gRPC API server."""
