"""The KV lifecycle service: its actor and client, the engines' ledgers, messages, the
KV decider, session ownership, session tokens and turn replay."""
