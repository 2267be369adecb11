"""Sampling on the device, inside the jitted step."""
