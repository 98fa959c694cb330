"""The `remp` command line (operators' tools): parses, calls the services, prints."""
