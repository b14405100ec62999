"""Generated gRPC/protobuf stubs of ``proto/tierkv/v1/tierkv.proto`` (``scripts/gen-proto``).

Do not edit: regenerate. ``tests/test_proto_stubs.py`` fails when they are stale.
"""
