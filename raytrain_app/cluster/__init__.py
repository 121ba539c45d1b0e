"""The Ray cluster this machine talks to: profiles, starting or joining it, its dashboard and capacity (driver side)."""
