"""Speculative decoding with a checkpoint's own multi-token-prediction head.

Read in the order data flows: `sampling` (what a draft and a verify draw from, and the
speculative-sampling rule), `rollback` (how every cache kind stands after a rejected draft),
`decode` (prefill, draft, verify, accept, roll back). The head itself is kvbank/mtp_head.py.
"""
