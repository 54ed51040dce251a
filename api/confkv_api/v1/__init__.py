"""Generated gRPC stubs of proto/confkv/v1 (do not edit; run scripts/gen-proto.sh)."""
