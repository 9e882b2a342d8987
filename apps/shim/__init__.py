"""The OpenAI-compatible HTTP API (`kvbank shim`): a client of the router like any other."""
