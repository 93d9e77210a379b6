"""The scheduler service (DESIGN §1 step 2)."""
