"""What the server and its same-host clients both map in shared memory, and how they read it.

The store writes these (``tierkv.store`` owns the HOST slab, the presence table and the lease
table); same-host clients map them: ``presence`` is the table that answers small lookups without
an RPC, ``liveness`` the lock files by which the server knows a client that maps the slab is
alive. Clients import this package, never ``tierkv.store``'s internals.
"""
