"""remp: live TP x PP topology switching for vLLM deployments.

This package holds what the services share (topology rules, errors, logging, gRPC plumbing, the
generated protocol code under ``remp/<service>/v1``) and the ``remp`` command line.
"""

__version__ = "0.1.0"
