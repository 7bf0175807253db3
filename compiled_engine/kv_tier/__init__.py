"""The KV tier: a prefix cache on local disk under the radix cache, so that a prefix outlives the
pool and a restart.

`store.py` keeps pages as files (checksummed, written atomically, bounded in size, least recently
used out first); `keys.py` names a page by the chained hash of its prefix's tokens, salted with
everything that changes its bytes; `tier.py` copies pages between the KV pool and the store: every
page the radix cache takes is written through (on a thread), and the prompt pages a request finds
there are read while it waits, then loaded into fresh pages when it is admitted (the ledger's
`LedgerParams.host_pages` and `StepPlan.tier_loads`)."""
