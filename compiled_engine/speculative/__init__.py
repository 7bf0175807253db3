"""Speculative decoding's engine side: the user's configuration and the drafters that propose tokens
(the ledger's side, acceptance and policy, is `compiled_engine.scheduler.speculation`)."""
