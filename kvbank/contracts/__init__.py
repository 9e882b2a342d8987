"""What the processes agree on, and nothing that runs: the words (vocabulary), the receipts
every policy returns, the failures and how each reaches a client, the price list, the health
checks, and the coldstore's wire messages (kvbank/v1/coldstore_pb2, from
proto/kvbank/v1/coldstore.proto).

This layer imports no process package (router, worker, coldstore, deploy) and no application
(apps); tests/test_layers.py holds that.
"""
