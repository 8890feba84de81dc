"""The sync-free plan (``SyncFreePlan``, plan.py, the config's ``sync_free``): every buffer and
split size from the config and T alone (``SyncFreeSizes``, sizes.py), so a step makes no host
read. Its exchanges (exchange.py: at EP > 1 the static-capacity exchange, chunks of fixed size)
carry check words in their status rows (words.py): a bad step's outputs are NaN on every rank,
and every rank raises the same error later."""
