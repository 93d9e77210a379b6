"""The gateway service (DESIGN §1 step 1)."""
