"""The ops dashboard: a small web service that reads the controller (and the policy) over gRPC."""
