"""Optimizers whose state lives off the device."""
