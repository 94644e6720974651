"""The runtime: the engine (one speculative step for every running sequence), the scheduler (who
runs, and the only place a sequence's status changes), a request's state, and how the parts are
built from model names."""
