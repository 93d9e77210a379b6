"""The decode service (DESIGN §1 step 4)."""
