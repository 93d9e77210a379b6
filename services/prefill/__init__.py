"""The prefill service (DESIGN §1 step 3)."""
