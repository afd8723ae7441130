"""genie-tcp: the TCP transport (placeholder until the transport lands)."""
