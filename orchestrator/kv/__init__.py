"""The KV lifecycle service: its actor and client, the engines' ledgers, messages, the
turn planner, session ownership, session tokens and turn replay."""
