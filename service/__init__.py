"""The gRPC sidecar around a ``TieredStore`` (see the service issue); nothing here yet."""
