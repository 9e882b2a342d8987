"""Speculative decoding with a checkpoint's own multi-token-prediction head.

Read in the order data flows: `sampling` (what a draft and a verify draw from, and the
speculative-sampling rule), then `decode` (prefill, draft, verify, accept, roll back). How
every cache kind stands after a rejected draft is the cache-kind seam's
(worker/kv/rollback.py); the head itself is kvbank/mtp_head.py.
"""
